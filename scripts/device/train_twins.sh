#!/usr/bin/env bash
# Twin drafters (issue 44): for one target, an EAGLE drafter per head choice (full, d/8, d/16,
# d/32) from the same self-distilled data, training settings, seed and schedule, so that ρ_τ
# compares like with like (conf: drafters.drafters.<name>.twin). One command line, repeated:
# each call runs until CALL_S seconds, saves the drafter it is training (train_state.pt) and
# exits; the next call (experiment.resume=true) continues it bit for bit, skips the finished
# twins and, once the last one is done, writes "finished": true into $RUN/twins.json. The data
# (first call) is cached by content under $CACHE, and its generation resumes too (job groups
# stored in <key>.partial/). Progress bars (tqdm, with ETA) show data generation, the feature
# pass and each twin's training; the log says which twin runs and where it paused.
#
# On the lent H200 (no network; hydra/omegaconf/antlr4 in .whl/site, gguf as a wheel in .whl/;
# the SmolLM2 GGUF travels in two halves; state lives on the box between calls while it stays
# warm, so run the calls back to back):
#   bash scripts/device/train_twins.sh part1          # SmolLM2 GGUF half 1 -> /dev/shm
#   bash scripts/device/train_twins.sh smollm2        # joins half 2; data, then training: repeat
#                                                     # until the log says "twins finished"
#   bash scripts/device/train_twins.sh fetch smollm2  # the 4 checkpoints + a tarball of their
#                                                     # provenance, records, logs -> $OUT
#   (here: checkpoints/smollm2_twin_<tag>.safetensors, <tag>/eagle_best.json from the tarball
#   as checkpoints/smollm2_twin_<tag>.json; ρ_τ: docs/heads.md, a drafter entry with `twin:`)
# Qwen2.5-Coder-1.5B: its Q4_K_M GGUF (1.1 GB) must be on the box first, at $QWEN_GGUF (e.g.
# joined from 60 MiB parts that travel one call each: split -b 60M into .device/qwen/ here,
# then `bash scripts/device/train_twins.sh qpart .device/qwen/partNN` per part, and `qjoin`):
#   bash scripts/device/train_twins.sh qwen           # repeat until "twins finished"
#   bash scripts/device/train_twins.sh fetch qwen     # Qwen twins are ~60-110 MB each: fetch
#                                                     # writes 15 MiB parts, FETCH_PART=k picks
#                                                     # which 4 of them come back in this call
# A local shape-only smoke of the same lines (CPU, dummy weights, a few steps):
#   HW=cpu SOURCE=dummy:smollm2-135m TINY=1 RUN=/tmp/twins_smoke bash scripts/device/train_twins.sh smollm2
set -euo pipefail
MODE=${1:-smollm2}
WHAT=${2:-smollm2}
OUT=${OUT:-outputs/train_twins}
HW=${HW:-h200}
CALL_S=${CALL_S:-480}          # training seconds per call (the device limit is 600 s a call)
HEADS=${HEADS:-[full,d/8,d/16,d/32]}   # the bar's drafters (full, d/8, d/16) finish first
SEED=${SEED:-0}
CACHE=${CACHE:-/dev/shm/eagle_data}
QWEN_GGUF=${QWEN_GGUF:-/dev/shm/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}
PY=${PYTHON:-python3}
# progress bars (tqdm: done/total, rate, ETA) every 20 s, one line each in the log
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TQDM_MININTERVAL=${TQDM_MININTERVAL:-20}
mkdir -p "$OUT"
if [ "$HW" != cpu ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD/.whl/site:$PWD FLASHSPEC_CACHE=/dev/shm/models
fi
SMOL_GGUF=/dev/shm/SmolLM2-135M-Instruct.Q4_1.gguf
case $MODE in
    part1) cp .device/gguf/part00 /dev/shm/part00; exit 0 ;;
    qpart) cp "$2" "/dev/shm/qwen_$(basename "$2")"; ls -la /dev/shm | tail -3; exit 0 ;;
    qjoin) cat /dev/shm/qwen_part* > "$QWEN_GGUF"; rm -f /dev/shm/qwen_part*; sha256sum "$QWEN_GGUF"; exit 0 ;;
    smollm2|qwen) WHAT=$MODE ;;
    fetch) ;;
    *) echo "usage: $0 part1 | smollm2 | qwen | qpart FILE | qjoin | fetch smollm2|qwen" >&2; exit 2 ;;
esac
RUN=${RUN:-/dev/shm/twins_$WHAT}
if [ "$MODE" = fetch ]; then   # what comes back: at most 8 files of 16 MiB, 64 MiB in all
    tar czf "$OUT/twins_$WHAT.tar.gz" -C "$RUN" twins.json $(cd "$RUN" && ls */eagle_best.json \
        */eagle_last.json */train_records.jsonl */done.json 2>/dev/null) ../twins_$WHAT.log 2>/dev/null \
        || tar czf "$OUT/twins_$WHAT.tar.gz" -C "$RUN" twins.json
    if [ "$WHAT" = smollm2 ]; then
        for d in "$RUN"/*/; do
            t=$(basename "$d"); [ -f "$d/eagle_best.safetensors" ] || continue
            cp "$d/eagle_best.safetensors" "$OUT/smollm2_twin_$t.safetensors"
        done
    else   # Qwen checkpoints exceed 16 MiB: 15 MiB parts, 4 per call (FETCH_PART=0,1,...)
        mkdir -p /dev/shm/qparts
        [ -n "$(ls /dev/shm/qparts)" ] || for d in "$RUN"/*/; do
            t=$(basename "$d"); [ -f "$d/eagle_best.safetensors" ] || continue
            split -b 15M -d -a 2 "$d/eagle_best.safetensors" "/dev/shm/qparts/qwen_twin_$t.part"
        done
        ls /dev/shm/qparts | sort | sed -n "$(( ${FETCH_PART:-0} * 4 + 1 )),$(( ${FETCH_PART:-0} * 4 + 4 ))p" \
            | while read -r f; do cp "/dev/shm/qparts/$f" "$OUT/$f"; done
        ls /dev/shm/qparts | sort > "$OUT/qparts.txt"
    fi
    ls -la "$OUT"; exit 0
fi
if [ "$WHAT" = smollm2 ]; then
    if [ "$HW" != cpu ]; then
        [ -f $SMOL_GGUF ] || cat /dev/shm/part00 .device/gguf/part01 > $SMOL_GGUF
        SOURCE=${SOURCE:-$SMOL_GGUF}
    fi
    TARGET=(target=smollm2 target.source=${SOURCE:-smollm2})
    STEPS=${STEPS:-4000}         # per twin: the data and 4 twins within one lent machine's hold (raise it when time allows)
    BATCH=${BATCH:-65536}
    N_SELF=${N_SELF:-"selfchat: 4000, selfmath: 1000, selfcode: 800"}
    SAMPLES=${SAMPLES:-"humaneval: 8, gsm8k: 2, mtbench: 8, selfchat: 1, selfmath: 1, selfcode: 1"}
    GEN_A=${GEN_A:-120}; GEN_B=${GEN_B:-120}; GEN_BATCH=${GEN_BATCH:-1024}
else
    TARGET=(target=qwen2.5-coder-1.5b target.source=${SOURCE:-$QWEN_GGUF})
    STEPS=${STEPS:-2000}         # a step costs more: d and V are 2.7 and 3.1 times SmolLM2's
    BATCH=${BATCH:-32768}
    N_SELF=${N_SELF:-"selfchat: 2000, selfmath: 500, selfcode: 1000"}
    SAMPLES=${SAMPLES:-"humaneval: 8, gsm8k: 1, mtbench: 4, selfchat: 1, selfmath: 1, selfcode: 1"}
    GEN_A=${GEN_A:-150}; GEN_B=${GEN_B:-150}; GEN_BATCH=${GEN_BATCH:-512}
fi
EVAL_EVERY=1000; EVAL_PROMPTS=8; MAX_NEW=256; MAX_LEN=768
if [ -n "${TINY:-}" ]; then    # a shape-only smoke: every line runs, in seconds per step
    STEPS=4; BATCH=1024; MAX_LEN=256; MAX_NEW=8; EVAL_EVERY=2; EVAL_PROMPTS=1; GEN_BATCH=4
    N_SELF=""; SAMPLES="humaneval: 1, gsm8k: 1, mtbench: 1"; GEN_A=30; GEN_B=30; CALL_S=${CALL_S_TINY:-40}
    DATASETS="humaneval: 1, gsm8k: 1, mtbench: 1"
fi
DATASETS=${DATASETS:-"humaneval: null, gsm8k: null, mtbench: null${N_SELF:+, $N_SELF}"}
ONES=$(echo "$DATASETS" | sed -E 's/: [a-z0-9]+/: 1/g')
# every call passes the same line: the run directory is tied to it (resume and the call's
# limits excepted), and the data cache and the twins' state are keyed by it
ARGS=(experiment=train_drafter hardware=$HW "${TARGET[@]}" logger=disabled seed=$SEED
      "output_dir=$RUN" "experiment.cache_dir=$CACHE" "experiment.heads=$HEADS"
      experiment.resume=true experiment.call_budget_s=$CALL_S experiment.save_every=1000
      "experiment.data.datasets={$DATASETS}" "experiment.data.samples={$ONES}"
      experiment.data.max_new_tokens=$MAX_NEW experiment.data.batch_size=$GEN_BATCH
      "experiment.data_mix=[{temperature: 0.0, time_budget_s: $GEN_A}, {temperature: 1.0, time_budget_s: $GEN_B, samples: {$SAMPLES}}]"
      experiment.train.steps=$STEPS experiment.train.batch_tokens=$BATCH experiment.train.lr=2.5e-3
      experiment.train.warmup=150 experiment.train.max_len=$MAX_LEN experiment.train.unroll=2
      experiment.train.unroll_from_step=0 experiment.train.eval_every=$EVAL_EVERY
      experiment.train.eval_prompts=$EVAL_PROMPTS experiment.train.eval_new_tokens=96
      experiment.train.log_every=50 experiment.train.val_fraction=0.02)
if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
fi
mkdir -p "$(dirname "$RUN")"
# a hard stop past the call's budget (data generation included in it, final evaluation not)
timeout $(( CALL_S + 100 )) $PY run.py "${ARGS[@]}" 2>&1 | tr '\r' '\n' \
    | tee -a "$(dirname "$RUN")/twins_$WHAT.log" | tail -40 || echo "run.py exited with an error or hit the hard stop"
cat "$RUN/twins.json" 2>/dev/null || true
if grep -q '"finished": true' "$RUN/twins.json" 2>/dev/null; then echo "twins finished"; else
    echo "twins paused: run the same command again"; fi
