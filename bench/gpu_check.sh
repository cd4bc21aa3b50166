#!/usr/bin/env bash
# GPU readiness check on a CUDA machine (about 5-6 minutes on an H200):
#   1. uses the checkout in place (PYTHONPATH) with whatever torch/triton the machine has,
#   2. runs the Triton kernel tests compiled on the GPU, the `gpu`-marked ones included, and the
#      engine's greedy parity with transformers on the GPU (tests/test_engine_cuda.py)
#      (--noconftest: the shared fixtures need Redis/model tooling that a GPU box may lack),
#   3. times the Triton decode (batch 64/256, contexts 1k/4k) against a plain read of as many bytes,
#      and two prefill cases (TFLOP/s),
#   4. runs bench.throughput on the GPU in bfloat16: ours against transformers' static batches,
#   5. where a redis-server is on the PATH, bench.service on the GPU (the service path at GPU step
#      speeds against the offline engine; its engine_over_offline_wall, engine_off_cpu_share (the
#      interpreter lock's share of the steps) and loop_service_share split the gap; the worker
#      with its engine process (the default) against the same tree's in-process one
#      (--no-engine-process: service_over_baseline); it
#      needs this project's service packages: redis, ...).
# Every step runs even when one before it failed; the exit status says whether all passed.
# Usage, from the repository root: bash bench/gpu_check.sh   (PYTHON=... to pick an interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
failed=()

step() {  # step NAME SECONDS CMD...: run with a time limit, remember a failure, go on
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date +%T))"
  timeout "$limit" "$@" || failed+=("$name")
}

step info 60 "$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA';
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
step tests 300 "$PY" -m pytest -q -p no:cacheprovider --noconftest -o addopts="" \
  tests/test_kernels_triton.py tests/test_engine_cuda.py
step triton-kernels 180 "$PY" -m bench.kernels --triton --repeats 20
step throughput 300 "$PY" -m bench.throughput --device cuda --dtype bfloat16 --preset full \
  --workload all --systems ours,hf-static --requests 256 --batch-sizes 64,256 --timeout 120
if command -v redis-server >/dev/null; then
  step service 300 "$PY" -m bench.service --preset tiny --device cuda --dtype bfloat16 \
    --rounds 3 --requests 384 --worker-flags=--engine-process --baseline-tree . \
    --baseline-flags=--no-engine-process
else
  echo "=== service: skipped (no redis-server on the PATH)"
fi

if ((${#failed[@]})); then
  echo "gpu_check: FAILED: ${failed[*]}"
  exit 1
fi
echo "gpu_check: all steps passed"
