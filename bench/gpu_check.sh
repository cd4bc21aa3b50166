#!/usr/bin/env bash
# GPU readiness check for the kernels package, on a CUDA machine (a few minutes, < 8).
#   1. uses the checkout in place (PYTHONPATH) with whatever torch/triton the machine has,
#   2. runs the Triton kernel tests compiled on the GPU, the `gpu`-marked ones included
#      (--noconftest: the shared fixtures need Redis/model tooling that a GPU box may lack),
#   3. times the Triton decode (batch 64/256, contexts 1k/4k) against a device-to-device copy.
# Usage, from the repository root: bash bench/gpu_check.sh   (PYTHON=... to pick an interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA';
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

timeout 300 "$PY" -m pytest -q -p no:cacheprovider --noconftest -o addopts="" \
  tests/test_kernels_triton.py
timeout 150 "$PY" -m bench.kernels --triton --repeats 20
