#!/usr/bin/env bash
# GPU run (one call, < 300 s): direct-launch probe, fused-verify benchmark, kernel tests with
# compiled Triton on CUDA. Writes env.log, probe.log, bench.log, kernel_bench.jsonl,
# kernel_bench_speedup.png, pytest.log to $OUT.
# The device box has torch/triton/PyYAML but no Hydra/OmegaConf/W&B: experiments/__init__.py
# imports omegaconf, so pure-Python copies of omegaconf + antlr4 travel in .whl/site (ignored):
#   mkdir -p .whl/site && cp -r .venv/lib/python3.*/site-packages/{omegaconf,antlr4} .whl/site/
# Run from the repository root:  OUT=DIR COMMIT=$(git rev-parse HEAD) bash scripts/device/kernel_bench.sh
# Knobs: DIRECT=auto|0|1 (auto: direct launch only if the probe matches the reference),
# SHAPES=full (all 24 shapes of the YAML) or a YAML list [[B,γ,V],...], PRECOMPILE=N processes,
# PRECOMPILE_TIMEOUT, PROBE_TIMEOUT, BENCH_TIMEOUT, TEST_TIMEOUT, EXAMPLES, WORKERS, TESTS_K,
# BENCH_ARGS.
set -o pipefail
OUT=${OUT:-outputs/kernel_bench_gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/.whl/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_DISABLE=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/.cache/triton}"   # shared with precompile workers
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/env.log"

# Default subset: every B in {1,8,64}, γ in {4,8}, V in {32000,49152,128256,151936}; the bar
# shape (64,4,128256) first; all six (B, γ) at V=128256; B=1 at every V.
DEFAULT_SHAPES='[[64,4,128256],[1,4,128256],[1,8,128256],[8,4,128256],[8,8,128256],[64,8,128256],[1,4,32000],[64,8,32000],[1,8,49152],[8,4,49152],[1,8,151936],[64,4,151936],[64,8,151936]]'
SHAPES=${SHAPES:-$DEFAULT_SHAPES}
SHAPE_ARG="shapes=$SHAPES"
[ "$SHAPES" = full ] && SHAPE_ARG="shapes=null"

# 1. compile every kernel variant of every shape in parallel (Triton's disk cache; the probe's
#    shapes are among the bench's), 2. direct-launch probe, 3. bench, 4. GPU tests.
timeout "${PRECOMPILE_TIMEOUT:-60}" python3 -m experiments.kernel_bench --out "$OUT" --hardware h200 \
  --precompile "${PRECOMPILE:-8}" --precompile-only --set "$SHAPE_ARG" 2>&1 | tail -5 | tee -a "$OUT/env.log"
echo "precompiled after $(( $(date +%s) - T0 )) s" | tee -a "$OUT/env.log"
DIRECT_ARG=""
case "${DIRECT:-auto}" in
  auto)
    if timeout "${PROBE_TIMEOUT:-35}" python3 -m experiments.kernel_bench \
        --out "$OUT" --probe-direct > "$OUT/probe.log" 2>&1; then
      DIRECT_ARG="--direct-launch"
    fi ;;
  1) DIRECT_ARG="--direct-launch" ;;
esac
echo "direct launch: ${DIRECT_ARG:-off} after $(( $(date +%s) - T0 )) s" | tee -a "$OUT/env.log"

timeout "${BENCH_TIMEOUT:-125}" python3 -m experiments.kernel_bench --out "$OUT" --hardware h200 \
  --commit "${COMMIT:-unknown}" $DIRECT_ARG --set compile_ref=false "$SHAPE_ARG" ${BENCH_ARGS:-} 2>&1 \
  | tee "$OUT/bench.log"
echo "bench done after $(( $(date +%s) - T0 )) s" | tee -a "$OUT/env.log"

TRITON_INTERPRET=0 FLASHSPEC_TRITON_EXAMPLES="${EXAMPLES:-6}" timeout "${TEST_TIMEOUT:-65}" \
  python3 -m pytest -q -n "${WORKERS:-8}" -p no:cacheprovider -k "${TESTS_K:-}" tests/test_triton_verify.py \
  2>&1 | tail -40 | tee "$OUT/pytest.log"
echo "all done after $(( $(date +%s) - T0 )) s" | tee -a "$OUT/env.log"
