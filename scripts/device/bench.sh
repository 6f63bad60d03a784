#!/usr/bin/env bash
# The headline GPU numbers: experiment=bench (conf/experiment/bench.yaml) on the lent H200, each
# cell a run.py job with its resolved config, provenance and decode records (no Hydra/W&B on
# the box: hydra, omegaconf and antlr4 travel in .whl/, gguf as a wheel in .whl/; the prompt
# files in .cache/data; the SmolLM2 GGUF in parts, .device/gguf/partNN, joined in order).
#   bash scripts/device/bench.sh part 00           # once per machine, one call per part
#   bash scripts/device/bench.sh part 01           # (carry .device/gguf/partNN alone; a call
#                                                  # carries 64 MiB with the tracked tree: two
#                                                  # halves (split -n 2) fit with checkpoints/
#                                                  # moved aside; three parts (split -n 3) with
#                                                  # checkpoints/ cut to the bench's drafter
#                                                  # (conf/drafters/bench.yaml), so one batch of
#                                                  # calls works with no change between them)
#   SEED=<a seed no committed record used> bash scripts/device/bench.sh [cells...]
#                                                  # carry .whl and .cache/data; on a lent H100
#                                                  # add HW=h100 (the profile cell then checks a100);
#                                                  # EXTRA="k=v 'k2={a: 1}' ..." adds overrides
#                                                  # to every model cell (priors.save=DIR; runpy
#                                                  # in env.sh)
# Cells: greedy (HumanEval and MT-Bench, B = 1, T = 0), t1 (both at T = 1), b32 (HumanEval,
# B = 32, 64 prompts), profile (HumanEval greedy with hardware=h100 runtime=resident: another
# CUDA profile on the resident loop must give the greedy cell's tokens, method by method).
# Each job's job_metrics.json holds <method>/{speedup_pooled,speedup,greedy_equal,alpha,tau}
# against `ar`, the resident AR (and bandit/vs_best_fixed: the Thompson method over the arms it
# picks from, against the best of them alone); everything lands in $OUT. Two more cells need no
# model: kernels (experiment=kernel_bench: fused Triton verify against the PyTorch reference)
# and heads (experiment=head_bench with CUDA-graph timing: ν per (d, V), Qwen's 1536 x 151,936
# included). trees: experiment=tree_tau (the 16-node trees against the 16-deep chain, τ and
# tok/s, greedy and T = 1, both datasets). hf: HF `generate` eager and compiled (static cache)
# beside our AR on the bench's prompts (the headline's HF row). tests: the compiled kernels'
# tests on CUDA (TRITON_INTERPRET=0 pytest tests/test_triton_head.py tests/test_triton_tree.py
# tests/test_triton_verify.py tests/test_grid_limits.py); pytest, pluggy, iniconfig, hypothesis, attrs and sortedcontainers
# travel as wheels in .whl/test/ (python 3.12 builds: pip download --python-version 3.12).
set -o pipefail
if [ "${1:-}" = part ]; then cp ".device/gguf/part$2" /dev/shm/ && ls -la /dev/shm; exit; fi
# An $OUT given by the environment (the device tool's) gets the job folders as one runs.tgz at
# the end: a call returns only a few files, and none under Hydra's folder names with = or %2F.
PACK=${PACK:-$([ -n "${OUT:-}" ] && echo 1 || echo 0)}
OUT=${OUT:-outputs/bench_gpu}
mkdir -p "$OUT"
source "$(dirname "$0")/env.sh"     # wheels, PYTHONPATH, $GGUF
if [ -n "$(echo " $* " | grep -E ' (greedy|t1|b32|profile|trees|hf) ')" ] || [ $# = 0 ]; then
  SEED=${SEED:?set SEED to a prompt draw no committed record used}   # the cells with a model
  [ -f $GGUF ] || cat /dev/shm/part?? > $GGUF                       # the parts, in order
fi
HW=${HW:-h200}                      # the card lent: h200 | h100 (the resident loop on either)
ALT=$([ "$HW" = h100 ] && echo a100 || echo h100)   # another CUDA profile for the profile cell
ARGS="experiment=bench hardware=$HW runtime=resident logger=disabled target.source=$GGUF dataset.seed=$SEED"
one() {
  case $1 in
    greedy) runpy -m $ARGS dataset=humaneval,mtbench hydra.sweep.dir=$OUT/greedy ;;
    t1)     runpy -m $ARGS dataset=humaneval,mtbench experiment.temperature=1.0 hydra.sweep.dir=$OUT/t1 ;;
    b32)    runpy $ARGS dataset=humaneval dataset.n_prompts=64 experiment.batch_size=32 hydra.run.dir=$OUT/b32 ;;
    profile) runpy $ARGS hardware=$ALT runtime=resident dataset=humaneval hydra.run.dir=$OUT/profile_$ALT &&
             python3 scripts/greedy_check.py $OUT/profile_$ALT/records.jsonl \
               --against "$(ls -d $OUT/greedy/0_*)/records.jsonl" ;;   # job 0: humaneval
    kernels) python3 run.py experiment=kernel_bench hardware=$HW logger=disabled hydra.run.dir=$OUT/kernel_bench ;;
    heads)  python3 run.py experiment=head_bench hardware=$HW logger=disabled experiment.cuda_graphs=true \
              hydra.run.dir=$OUT/head_bench ;;
    trees)  python3 run.py -m experiment=tree_tau hardware=$HW logger=disabled target.source=$GGUF \
              dataset.seed=$SEED dataset=humaneval,mtbench experiment.temperature=0,1 hydra.sweep.dir=$OUT/tree_tau ;;
    hf)     python3 run.py -m experiment=decode hardware=$HW logger=disabled target.source=$GGUF \
              dataset.seed=$SEED dataset=humaneval,mtbench dataset.n_prompts=24 +experiment.max_turns=1 \
              'experiment.methods=[ar,hf_generate,hf_compiled]' 'experiment.references=[]' hydra.sweep.dir=$OUT/hf ;;
    tests)  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/test/*.whl &&
            TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/test_triton_head.py tests/test_triton_tree.py \
              tests/test_triton_verify.py tests/test_grid_limits.py ;;
    *) echo "unknown cell $1 (greedy | t1 | b32 | profile | kernels | heads | trees | hf | tests)" >&2; return 2 ;;
  esac
}
for cell in ${@:-greedy t1 b32 profile}; do
  one "$cell" 2>&1 | grep --line-buffered -v "batch/s\]" | tee "$OUT/$cell.log"
done
for f in "$OUT"/*/job_metrics.json "$OUT"/*/*/job_metrics.json; do
  [ -f "$f" ] || continue
  python3 - "$f" <<'PY'
import json, sys
job = json.load(open(sys.argv[1]))
names = sorted({k.split("/")[0] for k in job if k.endswith("/speedup_pooled")})
print(sys.argv[1])
for m in names:
    print(f"  {m:16s} x{job[m + '/speedup_pooled']:.3f} (median {job.get(m + '/speedup', 0):.3f})"
          f"  alpha={job.get(m + '/alpha')}  tau={job.get(m + '/tau')}  equal={job.get(m + '/greedy_equal')}")
PY
done
if [ "$PACK" = 1 ]; then
  dirs=$(cd "$OUT" && ls -d */ 2>/dev/null)
  [ -n "$dirs" ] && (cd "$OUT" && tar czf runs.tgz $dirs && rm -rf $dirs) && ls -la "$OUT"
fi
