"""Save and load trained EAGLE drafters: safetensors weights + provenance (embedded and a .json).

A checkpoint holds ``module.*`` tensors (the :class:`EagleModule`), optionally ``head.*`` (a
trained low-rank head), and metadata: format, drafter config, the target dimensions it was
trained for, provenance. Loading checks every part and fails with one line naming the file:
not found, truncated / not safetensors, not a FlashSpec drafter, another target, tensors of
another shape, NaN or inf weights.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from flashspec.drafters.eagle_module import EagleConfig, EagleModule, config_dict
from flashspec.errors import FlashSpecError
from flashspec.models.llama import LlamaLM

FORMAT = "flashspec-eagle-v1"
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
              "head_dim")
RETRAIN = "retrain it with `python run.py experiment=train_drafter` or copy it again"


def target_signature(target: LlamaLM) -> dict[str, int]:
    """The target dimensions a drafter checkpoint is tied to."""
    return {k: int(getattr(target.shape, k)) for k in SHAPE_KEYS}


def save_eagle(path: str | Path, module: EagleModule, target: LlamaLM, head: nn.Module | None = None,
               provenance: dict[str, Any] | None = None, dtype: torch.dtype = torch.float16) -> Path:
    """Write ``path`` (.safetensors; ``module.*`` and, for a trained head, ``head.*`` tensors)
    and ``path.with_suffix('.json')`` with the same provenance in readable form."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {f"module.{k}": v for k, v in module.state_dict().items()}
    if head is not None:
        tensors.update({f"head.{k}": v for k, v in head.state_dict().items()})
    tensors = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
               for k, v in tensors.items()}
    meta = {"format": FORMAT, "config": config_dict(module.config),
            "target": target_signature(target), "head": _head_kind(head),
            "n_params": sum(p.numel() for p in module.parameters()),
            "dtype": str(dtype).removeprefix("torch."), "provenance": provenance or {}}
    save_file(tensors, str(path), metadata={k: json.dumps(v) for k, v in meta.items()})
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    return path


def _head_kind(head: nn.Module | None) -> dict[str, Any] | None:
    if head is None:
        return None
    if getattr(head, "kind", None) != "lowrank":
        raise FlashSpecError("only a low-rank head can be saved with an eagle drafter "
                             "(the full head is the target's own)")
    return {"kind": "lowrank", "rank": int(head.rank)}


def read_eagle_metadata(path: str | Path) -> dict[str, Any]:
    path = _existing(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = f.metadata() or {}
        meta = {k: json.loads(v) for k, v in raw.items()}
    except Exception as e:  # noqa: BLE001 - safetensors' own errors, bad JSON in the header
        raise FlashSpecError(f"eagle checkpoint {path} is unreadable, truncated or not a "
                             f"safetensors file ({type(e).__name__}: {_one_line(e)}); "
                             f"{RETRAIN}") from e
    if meta.get("format") != FORMAT:
        raise FlashSpecError(f"{path} is not a FlashSpec eagle drafter (format "
                             f"{meta.get('format')!r}); train one with experiment=train_drafter")
    return meta


def load_eagle(path: str | Path, target: LlamaLM
               ) -> tuple[EagleModule, nn.Module | None, dict[str, Any]]:
    """(module, trained head or None, metadata) on the target's device and dtype."""
    meta = read_eagle_metadata(path)
    want, have = meta.get("target"), target_signature(target)
    if want != have:
        want = want if isinstance(want, dict) else {}
        diff = {k: (want.get(k), have[k]) for k in have if want.get(k) != have[k]}
        raise FlashSpecError(f"eagle checkpoint {path} was trained for another target "
                             f"(checkpoint vs target: {diff})")
    try:
        config = EagleConfig(**meta["config"])
    except (KeyError, TypeError) as e:
        raise FlashSpecError(f"eagle checkpoint {path} has a broken drafter config "
                             f"({_one_line(e)}); {RETRAIN}") from e
    tensors = _read_tensors(path)
    module = EagleModule(target.shape, config)
    state = {k[len("module."):]: v for k, v in tensors.items() if k.startswith("module.")}
    try:
        module.load_state_dict(state)
    except RuntimeError as e:   # missing/unexpected keys or a tensor of another shape
        raise FlashSpecError(f"eagle checkpoint {path} does not match its own config "
                             f"({_one_line(e)}); {RETRAIN}") from e
    module = module.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    head = None
    if meta.get("head"):
        from flashspec.heads import LowRankHead
        if "head.w_down" not in tensors or "head.w_up" not in tensors:
            raise FlashSpecError(f"eagle checkpoint {path} declares a low-rank head but holds no "
                                 f"head.w_down / head.w_up tensors; {RETRAIN}")
        w_down, w_up = tensors["head.w_down"], tensors["head.w_up"]
        if w_down.shape[-1:] != (have["hidden_size"],) or w_up.shape[:1] != (have["vocab_size"],):
            raise FlashSpecError(f"eagle checkpoint {path}: head tensors {tuple(w_down.shape)} and "
                                 f"{tuple(w_up.shape)} do not map d={have['hidden_size']} to "
                                 f"V={have['vocab_size']}; {RETRAIN}")
        head = LowRankHead(w_down, w_up)
        head = head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    return module, head, meta


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the file; a truncated file or a NaN/inf weight is a FlashSpecError."""
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise FlashSpecError(f"eagle checkpoint {path} is truncated or corrupt "
                             f"({type(e).__name__}: {_one_line(e)}); {RETRAIN}") from e
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise FlashSpecError(f"eagle checkpoint {path} has NaN or inf weights in "
                             f"{', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''} (training "
                             f"diverged?); {RETRAIN}")
    return tensors


def _existing(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FlashSpecError(f"eagle checkpoint {path} not found; train one with `python run.py "
                             "experiment=train_drafter` or check drafters.*.checkpoint")
    return path


def _one_line(e: BaseException) -> str:
    text = " ".join(part.strip() for part in str(e).split("\n") if part.strip()) or "no message"
    return text if len(text) <= 240 else text[:237] + "..."
