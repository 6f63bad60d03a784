#!/usr/bin/env bash
# Set everything up (idempotent) and run the whole test suite on the CPU.
# Triton kernels run under the interpreter here (TRITON_INTERPRET=1); speed is measured on GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export TRITON_INTERPRET=1 WANDB_MODE=offline WANDB_SILENT=true
python -m pytest -q -p no:cacheprovider --durations=30 "$@"
