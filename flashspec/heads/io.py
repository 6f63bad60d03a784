"""Save and load heads (and token-frequency tables) as safetensors with provenance metadata."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flashspec.errors import FlashSpecError
from flashspec.heads.modules import FullHead, Head, LowRankHead, TruncatedHead

FORMAT = "flashspec-head-v1"
FREQ_FORMAT = "flashspec-token-frequencies-v1"


def _encode(meta: dict[str, Any]) -> dict[str, str]:
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}


def _decode(meta: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in meta.items():
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _tensors(head: Head) -> dict[str, torch.Tensor]:
    if isinstance(head, LowRankHead):
        return {"w_down": head.w_down, "w_up": head.w_up}
    if isinstance(head, TruncatedHead):
        return {"weight": head.weight, "keep_ids": head.keep_ids}
    if isinstance(head, FullHead):
        return {"weight": head.weight}
    raise FlashSpecError(f"cannot save head of type {type(head).__name__}")


def save_head(head: Head, path: str | Path, metadata: dict[str, Any] | None = None) -> Path:
    """Write ``head`` to ``path`` (.safetensors); ``metadata`` (provenance: data, steps, seed,
    commit, train prompt ids, ...) and ``head.distill_info`` (set by distill_lowrank) are
    stored JSON-encoded next to the head's shape."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {**getattr(head, "distill_info", {}), **(metadata or {}), "format": FORMAT,
            **head.describe()}
    tensors = {k: v.detach().contiguous().cpu() for k, v in _tensors(head).items()}
    save_file(tensors, str(path), metadata=_encode(meta))
    return path


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The decoded metadata of a saved head or frequency table."""
    with safe_open(str(_existing(path)), framework="pt") as f:
        return _decode(f.metadata() or {})


def load_head(path: str | Path, device: str | torch.device = "cpu",
              dtype: torch.dtype | None = None, layout: str | None = None
              ) -> tuple[Head, dict[str, Any]]:
    """(head, metadata) from a file written by :func:`save_head` (``layout``: the saved one
    unless given)."""
    path = _existing(path)
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            meta = _decode(f.metadata() or {})
            t = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise FlashSpecError(f"head file {path} is truncated, corrupt or not a safetensors file "
                             f"({type(e).__name__}); recreate it with "
                             "`python scripts/distill_head.py`") from None
    if meta.get("format") != FORMAT:
        raise FlashSpecError(f"{path} is not a FlashSpec head file (format {meta.get('format')!r})")
    # A diverged distillation saves NaN weights; loaded, they surface mid-decode as NaN logits
    # with no file named. Checked here, once per load.
    bad = [k for k, v in t.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise FlashSpecError(f"head file {path} has NaN or inf weights in {', '.join(bad)} "
                             "(distillation diverged?); recreate it with "
                             "`python scripts/distill_head.py`")
    cast = (lambda x: x.to(dtype)) if dtype is not None else (lambda x: x)
    kind = meta.get("kind")
    lay = layout or meta.get("layout") or "out_in"
    need = {"lowrank": ("w_down", "w_up"), "truncated": ("weight", "keep_ids"),
            "full": ("weight",)}.get(str(kind), ())
    missing = [k for k in need if k not in t]
    if missing:
        raise FlashSpecError(f"head file {path} ({kind} head) lacks the tensor(s) "
                             f"{', '.join(missing)}; recreate it with `python scripts/distill_head.py`")
    if kind == "lowrank":
        head: Head = LowRankHead(cast(t["w_down"]), cast(t["w_up"]), lay)
    elif kind == "truncated":
        head = TruncatedHead(cast(t["weight"]), t["keep_ids"], int(meta["vocab_size"]),
                             kept_rows=True, layout=lay)
    elif kind == "full":
        head = FullHead(cast(t["weight"]), lay)
    else:
        raise FlashSpecError(f"{path} holds an unknown head kind {kind!r}")
    return head, meta


def save_frequencies(freqs: torch.Tensor, path: str | Path,
                     metadata: dict[str, Any] | None = None) -> Path:
    """Write token counts [V] with provenance (which text, which prompts, which model)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {**(metadata or {}), "format": FREQ_FORMAT, "vocab_size": int(freqs.numel()),
            "total": int(freqs.sum())}
    save_file({"counts": freqs.detach().to(torch.int64).contiguous().cpu()}, str(path),
              metadata=_encode(meta))
    return path


def load_frequencies(path: str | Path) -> tuple[torch.Tensor, dict[str, Any]]:
    """(counts [V] int64, metadata) from :func:`save_frequencies`."""
    path = _existing(path, "token-frequency file")
    with safe_open(str(path), framework="pt") as f:
        meta = _decode(f.metadata() or {})
        counts = f.get_tensor("counts")
    if meta.get("format") != FREQ_FORMAT:
        raise FlashSpecError(f"{path} is not a FlashSpec token-frequency file")
    return counts, meta


def _existing(path: str | Path, what: str = "head file") -> Path:
    path = Path(path).expanduser()
    if not path.is_file():
        raise FlashSpecError(f"{what} {path} not found; check the path (head.checkpoint / "
                             "head.frequencies) or create it with `python scripts/distill_head.py`")
    return path
