#!/usr/bin/env bash
# The GPU check (issue 9): run on a machine with an NVIDIA GPU and torch with CUDA.
#   bash scripts/gpu_check.sh            # from the repository root
# Runs the engine-vs-reference tests on CUDA, the parity tests, and the step profile on the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
"$PY" -m pytest -q -p no:cacheprovider tests/unit/test_engine_cuda.py tests/unit/test_engine.py tests/parity
"$PY" scripts/profile_step.py --device cuda --streams 1 32 --steps 40
