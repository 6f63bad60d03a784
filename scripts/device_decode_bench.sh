#!/usr/bin/env bash
# GPU fast path end to end on the lent H200 (no network, no hydra/datasets/wandb: hydra,
# omegaconf and antlr4 travel as pure-Python copies in .whl/site, gguf as a wheel in .whl/;
# the SmolLM2 GGUF travels in two halves, see README "GPU").
#   bash scripts/device_decode_bench.sh part1      # copies .device/gguf/part00 to /dev/shm and
#                                                  # runs scripts/gpu_engine_check.py (graphs)
#   bash scripts/device_decode_bench.sh            # joins part01; checks; decode runs
# Everything lands in $OUT: logs and one tarball of the run directories (records, figures).
set -o pipefail
MODE=${1:-run}
OUT=${OUT:-outputs/decode_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false FLASHSPEC_CACHE=/dev/shm/models
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/site:$PWD
GGUF=/dev/shm/SmolLM2-135M-Instruct.Q4_1.gguf
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
if [ "$MODE" = part1 ]; then
  cp .device/gguf/part00 /dev/shm/part00
  nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/env.log"
  # engine checks on a random-weight SmolLM2 shape (fp32): greedy equality with/without graphs
  if [ -n "$SKIP_CHECK" ]; then echo 0 > /dev/shm/engine_check_rc; exit 0; fi
  timeout 150 python3 scripts/gpu_engine_check.py --quick --new 40 2>&1 | tee "$OUT/engine_check.log"
  echo "${PIPESTATUS[0]}" > /dev/shm/engine_check_rc
  exit 0
fi
[ -f $GGUF ] || cat /dev/shm/part00 .device/gguf/part01 > $GGUF
md5sum $GGUF | tee "$OUT/env.log"
GRAPHS=true BACKEND=triton
if [ "$(cat /dev/shm/engine_check_rc 2>/dev/null)" != 0 ]; then
  GRAPHS=false BACKEND=torch; el "engine check failed or missing: graphs off, torch verify"
fi
RUN="python3 run.py experiment=decode hardware=h200 hardware.cuda_graphs=$GRAPHS
     hardware.verify_backend=$BACKEND target.source=$GGUF
     logger=disabled drafters=gpu_ngram bandit=ucb1_gpu_tps"
ALL='experiment.methods=[ar,each_arm,spec,hf_generate,hf_compiled,hf_prompt_lookup]'
OURS='experiment.methods=[ar,each_arm,spec]'
one() {  # one named run: fp32 | he_b1 | mt_b1 | he_ours | he_b8 | he_b32
  el "$1"
  case $1 in
    fp32) timeout 90 $RUN target.dtype=float32 dataset=humaneval dataset.n_prompts=4 "$OURS" \
            output_dir=/tmp/runs/fp32_he && python3 scripts/greedy_check.py /tmp/runs/fp32_he/records.jsonl ;;
    he_b1) timeout 200 $RUN dataset=humaneval dataset.n_prompts=${N_HE:-6} "$ALL" output_dir=/tmp/runs/he_b1
           python3 scripts/greedy_check.py /tmp/runs/he_b1/records.jsonl ;;
    mt_b1) timeout 160 $RUN dataset=mtbench dataset.n_prompts=${N_MT:-3} "$ALL" output_dir=/tmp/runs/mt_b1 ;;
    he_ours) timeout 100 $RUN dataset=humaneval dataset.n_prompts=10 "$OURS" output_dir=/tmp/runs/he_ours ;;
    he_b8|he_b32) b=${1#he_b}; timeout ${BATCH_TIMEOUT:-50} $RUN dataset=humaneval dataset.n_prompts=$b \
           experiment.batch_size=$b "$OURS" output_dir=/tmp/runs/he_b$b ;;
  esac
}
runs() { for r in ${RUNS:-fp32 he_b1 mt_b1 he_b8 he_b32}; do one $r; done; el done; }
runs 2>&1 | grep --line-buffered -v "it/s\]\|batch/s\]" | tee "$OUT/decode.log"
tar czf "$OUT/decode_runs.tgz" -C /tmp/runs . && ls -la "$OUT"
