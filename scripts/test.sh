#!/usr/bin/env bash
# Set everything up (idempotent) and run the whole test suite on the CPU.
# Triton kernels run under the interpreter here (TRITON_INTERPRET=1); speed is measured on GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export TRITON_INTERPRET=1 WANDB_MODE=offline WANDB_SILENT=true
# Two workers (pytest-xdist), one math thread each: half the suite is single-threaded Python
# (interpreted Triton kernels, subprocess runs of run.py), so two workers use both cores of the
# CI box. Pass -n 0 to run serially.
export OMP_NUM_THREADS=1
python -m pytest -q -p no:cacheprovider --durations=30 -n 2 --dist worksteal "$@"
