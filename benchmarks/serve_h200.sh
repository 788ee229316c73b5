#!/usr/bin/env bash
# Issue 16's serving measurements on one lent H200, in the order of one hold (see
# benchmarks/RESULTS.md, "Serving on the H200"). Stage first, on a machine with the package
# index: `bash scripts/stage_gpu_host.sh` (.gpu/, ~44 MB; after scripts/test has built
# .venv) and `bash ../shared/gpu/stage_vllm.sh`. A transfer carries at most 64 MiB with the
# tree (~8.4 MB), so re-split the wheel into parts of 44, 54 and the rest (MB) in .vl1-.vl3
# and move deps/, SHA256, SIZE to .vl4 (each folder with install_vllm_offline.sh). One
# device call per step, issued back to back (the machine is given back after 30 s idle):
#   ours   (carry .gpu)   the ledger stack; serve.py: our engine in process and behind our
#                         HTTP server
#   prep   (carry .vl1)   the first chunk; the checkpoint vLLM loads
#   stage  (carry .vl2, then again with .vl3)  the next chunks
#   vllm   (carry .vl4)   vLLM installed; `vllm serve` default and VLLM_BATCH_INVARIANT=1
#   tests  (no carry)     the GPU engine tests; benchmarks/engine.py
#   threads (no carry)    our server under the old threaded load generator
# Logs go to $OUT (the device call's output folder) or ./serve-h200-out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-serve-h200-out}; mkdir -p "$OUT"
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1
CKPT=/root/ckpt/llama3-8b-shape
RATES=${RATES:-4,16,64}
REPEAT=${REPEAT:-1}       # runs of each rate per target (serve.py --repeat: medians, ranges)
serve() { python3 benchmarks/serve.py --device cuda --rates "$RATES" --requests 64 \
  --repeat "$REPEAT" "$@"; }
vl() { for d in .vl1 .vl2 .vl3 .vl4; do [ -d "$d" ] && bash "$d"/install_vllm_offline.sh | tail -1; done; }
case "${1:?step: ours, prep, stage, vllm, tests or threads}" in
  ours)
    bash .gpu/install.sh >/dev/null
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    serve --modes bi,serve --out "$OUT/ours" 2>"$OUT/ours.log" | tee "$OUT/ours.txt"
    ;;
  prep)
    vl
    python3 benchmarks/vllm.py weights --out "$CKPT" 2>&1 | tail -2
    ;;
  stage)
    vl
    ;;
  vllm)
    vl
    serve --modes none --vllm-model "$CKPT" --vllm default,flag --out "$OUT/vllm" \
      2>"$OUT/vllm.log" | tee "$OUT/vllm.txt"
    ;;
  tests)
    python3 -m pytest tests/engine/test_cuda_continuous.py tests/engine/test_cuda_invariance.py \
      tests/engine/test_cuda_kernels.py --noconftest -m gpu -q -p no:cacheprovider \
      2>&1 | tail -15 | tee "$OUT/gpu-tests.txt"
    python3 benchmarks/engine.py --device cuda --out "$OUT" 2>&1 | tail -20 | tee "$OUT/engine.txt"
    ;;
  threads)
    RATES=64 serve --modes serve --client threads --out "$OUT/threads" 2>"$OUT/threads.log" \
      | tee "$OUT/threads.txt"
    ;;
  *) echo "unknown step $1 (ours, prep, stage, vllm, tests, threads)" >&2; exit 2 ;;
esac
