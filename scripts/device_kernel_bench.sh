#!/usr/bin/env bash
# GPU run of the fused-verify benchmark and of the kernel tests with compiled Triton on CUDA.
# The device box has torch/triton/PyYAML but no Hydra/OmegaConf/W&B: experiments/__init__.py
# imports omegaconf, so pure-Python copies of omegaconf + antlr4 travel in .whl/site (ignored):
#   mkdir -p .whl/site && cp -r .venv/lib/python3.*/site-packages/{omegaconf,antlr4} .whl/site/
# Run from the repository root:  OUT=DIR COMMIT=$(git rev-parse HEAD) bash scripts/device_kernel_bench.sh
set -o pipefail
OUT=${OUT:-outputs/kernel_bench_gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/.whl/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/env.log"
timeout "${BENCH_TIMEOUT:-420}" python3 -m experiments.kernel_bench --out "$OUT" --hardware h200 \
  --commit "${COMMIT:-unknown}" --set time_budget_s="${COMPILE_BUDGET:-200}" ${BENCH_ARGS:-} \
  2>&1 | tee "$OUT/bench.log"
TRITON_INTERPRET=0 FLASHSPEC_TRITON_EXAMPLES="${EXAMPLES:-12}" timeout "${TEST_TIMEOUT:-150}" \
  python3 -m pytest -q -n "${WORKERS:-8}" -p no:cacheprovider -k "${TESTS_K:-}" tests/test_triton_verify.py \
  2>&1 | tail -40 | tee "$OUT/pytest.log"
