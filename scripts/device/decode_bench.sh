#!/usr/bin/env bash
# GPU fast path end to end on the lent H200 (no network, no hydra/datasets/wandb: hydra,
# omegaconf and antlr4 travel as pure-Python copies in .whl/site, gguf as a wheel in .whl/;
# the SmolLM2 GGUF travels in two halves).
#   bash scripts/device/decode_bench.sh part1      # copies .device/gguf/part00 to /dev/shm and
#                                                  # runs scripts/device/engine_check.py (graphs)
#   bash scripts/device/decode_bench.sh            # joins part01; checks; decode runs
# Everything lands in $OUT: logs and one tarball of the run directories (records, figures).
set -o pipefail
MODE=${1:-run}
OUT=${OUT:-outputs/decode_gpu}
mkdir -p "$OUT"
source "$(dirname "$0")/env.sh"     # wheels, PYTHONPATH, $GGUF
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
if [ "$MODE" = part1 ]; then
  cp .device/gguf/part00 /dev/shm/part00
  nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/env.log"
  # fused decode layers vs reference (fp32 equality incl. engine greedy, bf16 replay timing)
  if [ -n "$SKIP_FUSED_CHECK" ]; then echo 0 > /dev/shm/fused_rc; else
    timeout ${FUSED_TIMEOUT:-200} python3 scripts/device/fused_check.py 2>&1 | tee "$OUT/fused_check.log"
    echo "${PIPESTATUS[0]}" > /dev/shm/fused_rc
  fi
  if [ -n "$SKIP_CHECK" ]; then echo 0 > /dev/shm/engine_check_rc; exit 0; fi
  timeout ${CHECK_TIMEOUT:-150} python3 scripts/device/engine_check.py ${CHECK_ARGS:---quick} --new 40 2>&1 \
    | tee "$OUT/engine_check.log"
  echo "${PIPESTATUS[0]}" > /dev/shm/engine_check_rc
  exit 0
fi
if [ "$MODE" = ckpt ]; then  # the EAGLE drafter checkpoint travels in a call of its own
  cp checkpoints/smollm2_eagle_lr72.safetensors checkpoints/smollm2_eagle_lr72.json /dev/shm/ && ls -la /dev/shm
  exit 0
fi
[ -f $GGUF ] || cat /dev/shm/part00 .device/gguf/part01 > $GGUF
md5sum $GGUF | tee "$OUT/env.log"
GRAPHS=true BACKEND=triton
if [ "$(cat /dev/shm/engine_check_rc 2>/dev/null)" != 0 ]; then
  GRAPHS=false BACKEND=torch; el "engine check failed or missing: graphs off, torch verify"
fi
FUSED=true
if [ "$(cat /dev/shm/fused_rc 2>/dev/null)" != 0 ]; then
  FUSED=false; el "fused layer check failed or missing: reference layers"
fi
BASE="python3 run.py experiment=decode hardware=h200 runtime.cuda_graphs=$GRAPHS
     runtime.fused_layers=$FUSED runtime.verify_backend=$BACKEND target.source=$GGUF logger=disabled"
# ours: n-gram γ=8 with the goodput width planner (fixed arm 1 of gpu_ngram), each arm alone
RUN="$BASE drafters=gpu_ngram bandit=fixed bandit.arm=1 planner=goodput"
EAGLE="$BASE drafters=eagle_lowrank drafters.drafters.0.checkpoint=/dev/shm/smollm2_eagle_lr72.safetensors
       drafters.gammas=[4] planner=goodput"
ALL='experiment.methods=[ar,each_arm,spec,hf_generate,hf_compiled,hf_prompt_lookup]'
OURS='experiment.methods=[ar,each_arm,spec]'
one() {  # one named run: fp32 | he_b1 | mt_b1 | he_ours | he_b8 | he_b32 | eagle_fp32 | eagle_he | eagle_mt | scale
  el "$1"
  case $1 in
    fp32) timeout 90 $RUN target.dtype=float32 dataset=humaneval dataset.n_prompts=4 "$OURS" \
            output_dir=/tmp/runs/fp32_he && python3 scripts/greedy_check.py /tmp/runs/fp32_he/records.jsonl ;;
    he_b1) timeout 200 $RUN dataset=humaneval dataset.n_prompts=${N_HE:-6} "$ALL" output_dir=/tmp/runs/he_b1
           python3 scripts/greedy_check.py /tmp/runs/he_b1/records.jsonl ;;
    mt_b1) timeout 160 $RUN dataset=mtbench dataset.n_prompts=${N_MT:-3} "$ALL" output_dir=/tmp/runs/mt_b1 ;;
    mt_ours) timeout 90 $RUN dataset=mtbench dataset.n_prompts=${N_MT:-3} "$OURS" output_dir=/tmp/runs/mt_ours ;;
    he_ours) timeout 100 $RUN dataset=humaneval dataset.n_prompts=10 "$OURS" output_dir=/tmp/runs/he_ours ;;
    eagle_fp32) timeout 80 $EAGLE target.dtype=float32 dataset=humaneval dataset.n_prompts=3 "$OURS" \
            output_dir=/tmp/runs/eagle_fp32 && python3 scripts/greedy_check.py /tmp/runs/eagle_fp32/records.jsonl ;;
    eagle_he|eagle_mt) d=$([ $1 = eagle_he ] && echo humaneval || echo mtbench)
           timeout 100 $EAGLE dataset=$d dataset.n_prompts=${N_EAGLE:-8} "$OURS" output_dir=/tmp/runs/$1 ;;
    scale) # step costs at scale: Llama-3.1-8B-shaped target, Llama-3.2-1B-shaped drafter (random weights)
           timeout ${SCALE_TIMEOUT:-150} python3 scripts/device/scale_timing.py --batch 1 8 \
             $([ $FUSED = true ] && echo --fused) --out /tmp/runs/scale_timing.jsonl | tail -40 ;;
    he_b8|he_b32) b=${1#he_b}; timeout ${BATCH_TIMEOUT:-50} $RUN dataset=humaneval dataset.n_prompts=${N_BATCHED:-$b} \
           experiment.batch_size=$b "$OURS" output_dir=/tmp/runs/he_b$b ;;
  esac
}
runs() { for r in ${RUNS:-fp32 he_b1 mt_b1 he_b8 he_b32}; do one $r; done; el done; }
runs 2>&1 | grep --line-buffered -v "it/s\]\|batch/s\]" | tee "$OUT/decode.log"
tar czf "$OUT/decode_runs.tgz" -C /tmp/runs . && ls -la "$OUT"
