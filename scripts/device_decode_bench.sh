#!/usr/bin/env bash
# GPU fast path end to end on the lent H200 (no network, no hydra/datasets/wandb: hydra,
# omegaconf and antlr4 travel as pure-Python copies in .whl/site, gguf as a wheel in .whl/;
# the SmolLM2 GGUF travels in two halves, see README "GPU").
#   bash scripts/device_decode_bench.sh part1      # copies .device/gguf/part00 to /dev/shm
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
if [ "$MODE" = part1 ]; then cp .device/gguf/part00 /dev/shm/part00; exit 0; fi
[ -f $GGUF ] || cat /dev/shm/part00 .device/gguf/part01 > $GGUF
md5sum $GGUF | tee "$OUT/env.log"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee -a "$OUT/env.log"
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
# 1. engine checks on a random-weight SmolLM2 shape (fp32): greedy equality with/without graphs
el "engine check"
timeout 150 python3 scripts/gpu_engine_check.py --quick --new 40 2>&1 | tee "$OUT/engine_check.log"
GRAPHS=true; [ "${PIPESTATUS[0]}" = 0 ] || { GRAPHS=false; el "engine check failed: graphs off"; }
RUN="python3 run.py experiment=decode hardware=h200 hardware.cuda_graphs=$GRAPHS target.source=$GGUF
     logger=disabled drafters=gpu_ngram bandit=ucb1_tps_gpu"
ALL='experiment.methods=[ar,each_arm,spec,hf_generate,hf_compiled,hf_prompt_lookup]'
runs() {
  # fp32 greedy: every speculative method must equal target-only AR token for token
  el fp32; timeout 120 $RUN target.dtype=float32 dataset=humaneval dataset.n_prompts=6 \
      'experiment.methods=[ar,each_arm,spec]' output_dir=/tmp/runs/fp32_he
  python3 scripts/greedy_check.py /tmp/runs/fp32_he/records.jsonl
  el he_b1; timeout 240 $RUN dataset=humaneval dataset.n_prompts=${N_HE:-8} "$ALL" output_dir=/tmp/runs/he_b1
  python3 scripts/greedy_check.py /tmp/runs/he_b1/records.jsonl
  el mt_b1; timeout 200 $RUN dataset=mtbench dataset.n_prompts=${N_MT:-4} "$ALL" output_dir=/tmp/runs/mt_b1
  for b in 8 32; do
    el he_b$b; timeout 90 $RUN dataset=humaneval dataset.n_prompts=$b experiment.batch_size=$b \
        'experiment.methods=[ar,each_arm,spec]' output_dir=/tmp/runs/he_b$b
  done
  el done
}
runs 2>&1 | grep --line-buffered -v "it/s\]\|batch/s\]" | tee "$OUT/decode.log"
tar czf "$OUT/decode_runs.tgz" -C /tmp/runs . && ls -la "$OUT"
