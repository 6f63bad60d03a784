#!/usr/bin/env bash
# The Qwen2.5-Coder pair on a lent GPU (no network there). Its two registry GGUFs (1.1 GB and
# 0.5 GB, prepared here by scripts/prepare_model.py) travel in 56 MB parts, one part per call, and
# are joined and converted on /dev/shm; every measurement is a run.py job.
#   bash scripts/device/qwen.sh split [q15|q05]  # here: the parts, one directory per call,
#                                                # under .device/qwen/<q15|q05>/dNN/ (PART_BYTES,
#                                                # 56 MB: 59 MB still fits with checkpoints/ aside)
#   bash scripts/device/qwen.sh part q15 dNN     # there, once per part (carry .device/qwen/q15/dNN
#                                                # alone, checkpoints/ moved aside: with the tracked
#                                                # tree a part is over a call's 64 MiB); the same
#                                                # for q05 (the 0.5B: draft LM, heads)
#   bash scripts/device/qwen.sh setup            # join, check the pins, convert (~4 min)
#   S=<a seed no record used> bash scripts/device/qwen.sh he mt gsm fp32 nf4 heads
#                                                # carry .whl, .bnb (nf4) and .cache/data
#   EXTRA="k=v ..." adds overrides to every measurement stage (runtime.kernels.head_triton=true)
#   S=<seed> bash scripts/device/qwen.sh train   # an EAGLE drafter for the 1.5B (1.5B parts
#                                                # only): experiment=train_drafter_qwen, one
#                                                # call-sized piece per call (repeat until its
#                                                # log says finished); then the stages eagle
#                                                # (head_decode_qwen_eagle: ν, κ on that drafter)
#                                                # and eagle_he / eagle_mt / eagle_gsm (decode vs
#                                                # AR, greedy and T = 1), eagle_fp32 (greedy
#                                                # equality in fp32); HW (h100, h200) is read
#                                                # from nvidia-smi unless set.
#   S=<seed> bash scripts/device/qwen.sh eagle_tree  # its chain beside dynamic / three-branch trees
#   S=<seed> bash scripts/device/qwen.sh card    # the design card's sweep on the 1.5B (its drafter
#                                                # carried with ckin; N prompts, default 24)
#   MIX="<draws>" S=<draw> bash scripts/device/qwen.sh mixed   # experiment=mixed_stream with the
#                                                # drafter, prompt lookup and (its parts carried)
#                                                # the 0.5B, one job per draw in MIX
#   bash scripts/device/qwen.sh ckpt N           # there, N = 0, 1, 2: the trained drafter back
#                                                # in 16 MB pieces (cat c* here; ckpt.sha256)
#   bash scripts/device/qwen.sh cksplit F.safetensors  # here: a drafter brought back earlier, in
#                                                # parts under .device/qwen/ck/dNN (its .json in d00)
#   bash scripts/device/qwen.sh ckin dNN         # there, once per part (carry .device/qwen/ck/dNN):
#                                                # the stages join them into $DRAFTER, no training
# Stages: he/mt/gsm (AR, HF generate eager + compiled on he, the 0.5B draft LM at γ 2-5, prompt
# lookup, UCB1 over them; 24 prompts), fp32 (greedy equality of every arm in fp32), nf4 (the
# 1.5B in NF4 beside bf16: bitsandbytes from a carried wheel in .bnb/), heads
# (experiment=head_decode_qwen and head_decode_qwen05: ν CUDA-graph timed, κ on the resident
# loop). Runs land in /tmp/qwen_runs; each stage's log and one tarball of all runs in $OUT.
set -o pipefail
OUT=${OUT:-outputs/qwen_gpu}
PARTS=${PARTS:-.device/qwen}
mkdir -p "$OUT"
MODELS="qwen2.5-coder-1.5b:q15 qwen2.5-coder-0.5b:q05"
to_parts() {   # FILE DIR: FILE in call-sized parts, one per folder DIR/dNN/pNN (one carry each)
  rm -rf "$2" && mkdir -p "$2/tmp" && split -b ${PART_BYTES:-56000000} -d -a 2 "$1" "$2/tmp/p" &&
    for f in "$2"/tmp/p*; do d="$2/d${f##*/p}"; mkdir -p "$d" && mv "$f" "$d/"; done &&
    rmdir "$2/tmp"
}
case ${1:-} in
  split)
    [ -n "${2:-}" ] && MODELS=$(echo $MODELS | tr ' ' '\n' | grep ":$2$")
    PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
    for m in $MODELS; do name=${m%%:*}; tag=${m##*:}
      src=$(PYTHONPATH=$PWD $PY scripts/prepare_model.py "$name" --where) || exit 1
      [ -f "$src" ] || { echo "$name not prepared: python scripts/prepare_model.py $name" >&2; exit 1; }
      to_parts "$src" "$PARTS/$tag" || exit 1
      echo "$name: $(ls "$PARTS/$tag" | wc -l) parts in $PARTS/$tag"
    done; exit 0;;
  part)
    mkdir -p "/dev/shm/qwen_parts/$2" && cp "$PARTS/$2/$3"/p* "/dev/shm/qwen_parts/$2/" &&
      echo "$2: $(ls "/dev/shm/qwen_parts/$2" | wc -l) parts on the box"; exit;;
  cksplit)  # here: a drafter checkpoint (and the .json beside it) into call-sized parts
    to_parts "$2" "$PARTS/ck" && cp "${2%.safetensors}.json" "$PARTS/ck/d00/eagle_best.json" || exit 1
    sha256sum "$2"; ls "$PARTS/ck"; exit;;
  ckin)   # there: one part of a drafter checkpoint (the stages join the parts into $DRAFTER)
    mkdir -p /dev/shm/qwen_drafter/in && cp "$PARTS/ck/$2"/* /dev/shm/qwen_drafter/in/ &&
      ls /dev/shm/qwen_drafter/in; exit;;
  ckpt)   # there: piece N (0, 1, 2) of the trained drafter into $OUT, four 16 MB files a call
    f=${DRAFTER:-/dev/shm/qwen_drafter/train/eagle_best.safetensors}
    mkdir -p /dev/shm/ckpt_parts && [ -f /dev/shm/ckpt_parts/c00 ] || split -b 16000000 -d -a 2 "$f" /dev/shm/ckpt_parts/c
    [ "$2" = 0 ] && sha256sum "$f" | tee "$OUT/ckpt.sha256"
    for i in 0 1 2 3; do n=$(printf %02d $(( $2 * 4 + i ))); [ -f /dev/shm/ckpt_parts/c$n ] && cp /dev/shm/ckpt_parts/c$n "$OUT/"; done
    ls -la "$OUT"; exit;;
esac
source "$(dirname "$0")/env.sh"     # wheels, PYTHONPATH, model cache on /dev/shm
if [ -d .bnb ] && [ ! -d /tmp/site/bitsandbytes ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .bnb/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PYTHONPATH HYDRA_FULL_ERROR=1
S=${S:?set S to a prompt draw no committed record used}
HW=${HW:-$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo h200 || echo h100)}
R=/tmp/qwen_runs; mkdir -p $R
QD=/dev/shm/qwen_drafter           # the drafter's run dir and data cache (~160 MB checkpoint: it
DRAFTER=${DRAFTER:-$QD/train/eagle_best.safetensors}  # stays on the box (the stage ckpt brings
                                   # it back in pieces); its records and .json come back)
if [ ! -f "$DRAFTER" ] && ls $QD/in/p?? >/dev/null 2>&1; then   # parts carried with ckin
  mkdir -p "$(dirname "$DRAFTER")" && cat $QD/in/p?? > "$DRAFTER" &&
    cp $QD/in/eagle_best.json "${DRAFTER%.safetensors}.json" && sha256sum "$DRAFTER"
fi
BASE="runpy hardware=$HW runtime=resident target=qwen2.5-coder-1.5b logger=disabled seed=$S dataset.seed=$S dataset.n_prompts=24"
ARMS="experiment.references=[each_arm] bandit=ucb1"   # every arm alone beside UCB1 over them
DEC="$BASE drafters=qwen_coder $ARMS"
QUIET='it/s\]|s/it\]|prompt/s\]|batch/s\]'
stage() {
  case $1 in
    setup)  # both models at once (their dequantisations overlap on the box's cores)
      for m in $MODELS; do name=${m%%:*}; tag=${m##*:}
        [ -d /dev/shm/qwen_parts/$tag ] || { echo "no parts of $name on the box"; continue; }
        dest=$(python3 scripts/prepare_model.py "$name" --where); mkdir -p "$(dirname "$dest")"
        [ -f "$dest" ] || cat /dev/shm/qwen_parts/$tag/p* > "$dest"
        python3 scripts/prepare_model.py "$name" --offline > "$R/setup_$tag.log" 2>&1 &  # pins, header, convert
      done
      ok=0; for job in $(jobs -p); do wait "$job" || ok=1; done
      tail -q -n 4 $R/setup_*.log; return $ok;;
    he)  $DEC dataset=humaneval 'experiment.methods=[ar,spec,each_arm,hf_generate,hf_compiled]' hydra.run.dir=$R/he;;
    mt)  $DEC dataset=mtbench 'experiment.methods=[ar,spec,each_arm]' hydra.run.dir=$R/mt;;
    gsm) $DEC dataset=gsm8k 'experiment.methods=[ar,spec,each_arm]' hydra.run.dir=$R/gsm;;
    fp32) $DEC hardware.dtype=float32 dataset=humaneval dataset.n_prompts=4 dataset.max_new_tokens=64 \
            'experiment.methods=[ar,each_arm]' hydra.run.dir=$R/fp32;;
    nf4) for q in nf4 bf16; do
           $DEC dataset=humaneval dataset.n_prompts=8 'experiment.methods=[ar,each_arm]' \
             'drafters.arms=[[coder05b,3],[ngram,3]]' bandit=fixed \
             $([ $q = nf4 ] && echo hardware.quantization=nf4) hydra.run.dir=$R/$q || return 1
         done;;
    mixed) # the mixed stream with one arm of each kind (conf/drafters/qwen_mixed.yaml), one job
           # per draw in MIX (default S); without the 0.5B's parts on the box, its two arms only
           for d in ${MIX:-$S}; do
             $BASE experiment=mixed_stream drafters=qwen_mixed drafters.drafters.eagle_qwen.checkpoint=$DRAFTER \
               $([ -d /dev/shm/qwen_parts/q05 ] || echo "~drafters.drafters.coder05b drafters.arms=[[ngram,3],[eagle_qwen,3]]") \
               dataset.seed=$d hydra.run.dir=$R/mixed_s$d || return 1
           done;;
    train) python3 run.py experiment=train_drafter_qwen hardware=$HW runtime=resident logger=disabled \
             seed=${TS:-$S} experiment.resume=true experiment.call_budget_s=${BUDGET:-540} \
             output_dir=$QD/train experiment.cache_dir=$QD/data; rc=$?
           mkdir -p $R/train_drafter_qwen && cp $QD/train/*.json* $R/train_drafter_qwen/ 2>/dev/null
           return $rc;;
    eagle) $BASE experiment=head_decode_qwen_eagle experiment.drafter.checkpoint=$DRAFTER \
             hydra.run.dir=$R/head_decode_qwen_eagle;;
    eagle_fp32)  # greedy equality of the trained drafter's arms in fp32 (4 prompts x 64)
           $BASE hardware.dtype=float32 drafters=qwen_eagle drafters.drafters.eagle_qwen.checkpoint=$DRAFTER \
             dataset=humaneval dataset.n_prompts=4 dataset.max_new_tokens=64 $ARMS \
             'experiment.methods=[ar,each_arm]' hydra.run.dir=$R/eagle_fp32;;
    eagle_he|eagle_mt|eagle_gsm)
           ds=$(case $1 in eagle_he) echo humaneval;; eagle_mt) echo mtbench;; *) echo gsm8k;; esac)
           for t in 0.0 1.0; do
             $BASE drafters=qwen_eagle drafters.drafters.eagle_qwen.checkpoint=$DRAFTER dataset=$ds \
               experiment.temperature=$t $ARMS 'experiment.methods=[ar,spec,each_arm]' \
               hydra.run.dir=$R/${1}_t${t%.0} || return 1
           done;;
    eagle_tree)  # the trained drafter's chain beside its trees, alone and under UCB1, greedy and
           # T = 1 (at T = 1 the shallow three-branch tree the bench uses), on TREE_DS
           for ds in ${TREE_DS:-humaneval mtbench}; do for t in 0.0 1.0; do
             arms=$([ $t = 0.0 ] && echo "[[eagle_qwen,4],[eagle_qwen,dyn15d6k4],[eagle_qwen,dyn31d7k6]]" \
                                 || echo "[[eagle_qwen,3],[eagle_qwen,3x1x1],[eagle_qwen,2x1x1]]")
             $BASE drafters=qwen_eagle drafters.drafters.eagle_qwen.checkpoint=$DRAFTER dataset=$ds \
               experiment.temperature=$t "drafters.arms=$arms" $ARMS 'experiment.methods=[ar,spec,each_arm]' \
               hydra.run.dir=$R/tree_${ds}_t${t%.0} || return 1
           done; done;;
    card)  # the design card's sweep on this target as a user types it (its drafter set is the
           # target's own, whose checkpoint path is linked to the carried drafter; d/16's head is
           # trained on first use), 24 prompts of draw S; no wandb on the box
           mkdir -p .cache/drafters && ln -sf "$DRAFTER" .cache/drafters/qwen2.5-coder-1.5b.safetensors &&
             ln -sf "${DRAFTER%.safetensors}.json" .cache/drafters/qwen2.5-coder-1.5b.json || return 1
           runpy -m hardware=$HW target=qwen2.5-coder-1.5b bandit=ucb1,thompson head.rank=d/8,d/16 \
             logger=disabled seed=$S dataset.seed=$S dataset.n_prompts=${N:-24} hydra.sweep.dir=$R/card;;
    heads) $BASE experiment=head_decode_qwen hydra.run.dir=$R/head_decode_qwen || return 1
           [ -d /dev/shm/qwen_parts/q05 ] || { echo "no 0.5B on the box: head_decode_qwen05 skipped"; return 0; }
           $BASE experiment=head_decode_qwen05 hydra.run.dir=$R/head_decode_qwen05;;
    *) echo "unknown stage $1 (setup he mt gsm fp32 nf4 heads train eagle eagle_fp32 eagle_he eagle_mt eagle_gsm eagle_tree mixed card)" >&2; return 2;;
  esac
}
for s in "$@"; do
  echo "=== $s $(date +%T)"
  stage "$s" 2>&1 | grep --line-buffered -Ev "$QUIET" > "$OUT/$s.log"; rc=${PIPESTATUS[0]}
  tail -25 "$OUT/$s.log"; [ "$rc" = 0 ] || echo "=== $s failed (rc $rc)"
done
tar czf "$OUT/qwen_runs.tgz" -C $R . && ls -la "$OUT"
