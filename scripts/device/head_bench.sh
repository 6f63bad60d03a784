#!/usr/bin/env bash
# GPU run of the low-rank head's Triton up projection: compiled-kernel tests on CUDA, the head
# bench (full vs lowrank_d/N (cuBLAS) vs lowrank_triton_d/N, CUDA-graph replays) and a tile
# sweep of the up projection alone. Torch + triton only (pytest for the tests); the pure-Python
# omegaconf/antlr4 copies in .whl/site (ignored) are on PYTHONPATH as in kernel_bench.sh:
#   mkdir -p .whl/site && cp -r .venv/lib/python3.*/site-packages/{omegaconf,antlr4} .whl/site/
# Run from the repository root:  OUT=DIR bash scripts/device/head_bench.sh   (~2 min)
# Writes to OUT: env.log pytest.log bench.log head_bench.jsonl nu_vs_rank.png sweep.log sweep.jsonl
set -o pipefail
OUT=${OUT:-outputs/head_bench_gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/.whl/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/env.log"
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-8}")
timeout "${TEST_TIMEOUT:-50}" python3 -m pytest -q $XDIST -p no:cacheprovider \
  tests/test_triton_head.py 2>&1 | tail -40 | tee "$OUT/pytest.log"
timeout "${BENCH_TIMEOUT:-60}" python3 -m flashspec.analysis.head_bench --device cuda --cuda-graphs \
  --shapes 4096:128256 576:49152 --batches 1 64 --rank-divs ${RANK_DIVS:-8 32} \
  --budget-s "${BUDGET_S:-4}" --out "$OUT" 2>&1 | tr '\r' '\n' | tail -30 | tee "$OUT/bench.log"
timeout "${SWEEP_TIMEOUT:-30}" python3 scripts/device/head_triton_sweep.py --out "$OUT" \
  --budget-s "${SWEEP_BUDGET_S:-22}" 2>&1 | tail -80 | tee "$OUT/sweep.log"
python3 - "$OUT/head_bench.jsonl" <<'PY' 2>&1 | tee -a "$OUT/bench.log"
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    if r["kind"] in ("full", "lowrank", "lowrank_triton"):
        print(f"{r['shape']:14s} B={r['batch']:<3d} {r['variant']:20s} {r['latency_us']:8.1f} us"
              f"  nu={r['nu']:.3f} (paired {r['nu_paired']:.3f})  ideal={r['ideal_nu'] or 1:.3f}")
PY
