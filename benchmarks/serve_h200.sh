#!/usr/bin/env bash
# Issue 16's serving measurements on one lent H200, in the order of one hold (see
# benchmarks/RESULTS.md, "Serving on the H200"). Stage first, on a machine with the package
# index: `bash scripts/stage_gpu_host.sh` (.gpu/) and `bash ../shared/gpu/stage_vllm.sh`
# (.vl1/ .vl2/ .vl3/; if the tree plus one chunk exceeds a transfer, re-split the wheel into
# 50 MiB parts in .vl1-.vl3 and its deps/, SHA256, SIZE in .vl4). One device call per step:
#   tests  (carry .gpu)  the ledger stack; the GPU engine tests; benchmarks/engine.py
#   ours   (carry .vl1)  serve.py: our engine in process and behind our HTTP server
#   prep   (carry .vl2)  the checkpoint vLLM loads; our server with the old threaded client
#   vllm   (carry .vl3)  vLLM installed; `vllm serve` default and VLLM_BATCH_INVARIANT=1
# Logs go to $OUT (the device call's output folder) or ./serve-h200-out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-serve-h200-out}; mkdir -p "$OUT"
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1
CKPT=/root/ckpt/llama3-8b-shape
RATES=${RATES:-4,16,64}
serve() { python3 benchmarks/serve.py --device cuda --rates "$RATES" --requests 64 "$@"; }
case "${1:?step: tests, ours, prep or vllm}" in
  tests)
    bash .gpu/install.sh
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    python3 -m pytest tests/engine/test_cuda_continuous.py tests/engine/test_cuda_invariance.py \
      tests/engine/test_cuda_kernels.py --noconftest -m gpu -q -p no:cacheprovider \
      2>&1 | tail -15 | tee "$OUT/gpu-tests.txt"
    python3 benchmarks/engine.py --device cuda --out "$OUT" 2>&1 | tail -20 | tee "$OUT/engine.txt"
    ;;
  ours)
    bash .vl1/install_vllm_offline.sh | tail -1
    serve --modes bi,serve --out "$OUT/ours" 2>"$OUT/ours.log" | tee "$OUT/ours.txt"
    ;;
  prep)
    bash .vl2/install_vllm_offline.sh | tail -1
    python3 benchmarks/vllm.py weights --out "$CKPT" 2>&1 | tail -2
    RATES=64 serve --modes serve --client threads --out "$OUT/threads" 2>"$OUT/threads.log" \
      | tee "$OUT/threads.txt"
    ;;
  vllm)
    for d in .vl3 .vl4; do [ -d "$d" ] && bash "$d"/install_vllm_offline.sh | tail -1; done
    serve --modes none --vllm-model "$CKPT" --vllm default,flag --out "$OUT/vllm" \
      2>"$OUT/vllm.log" | tee "$OUT/vllm.txt"
    ;;
  *) echo "unknown step $1 (tests, ours, prep, vllm)" >&2; exit 2 ;;
esac
