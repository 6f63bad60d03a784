"""Build a drafter head from a ``conf/head/*.yaml`` mapping (plain dict or DictConfig)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from flashspec.errors import FlashSpecError
from flashspec.heads.io import load_frequencies, load_head
from flashspec.heads.modules import FullHead, Head, LowRankHead, TruncatedHead
from flashspec.theory import equal_cost_keep

log = logging.getLogger(__name__)

KINDS = ("full", "lowrank", "truncated")
INITS = ("svd", "asvd")


def resolve_rank(rank: int | str | None, hidden: int) -> int:
    """Rank as an int: 72, '72', 'd/8', '3d/4' (flashspec.config.parse_rank)."""
    if rank is None:
        raise FlashSpecError("head.kind=lowrank needs head.rank (e.g. head.rank=d/8)")
    if isinstance(rank, bool):
        raise FlashSpecError(f"head.rank {rank!r} is not an int or 'd/N'")
    from flashspec.config import parse_rank  # lazy: flashspec.config imports omegaconf
    try:
        return parse_rank(rank if isinstance(rank, str) else int(rank), hidden)
    except FlashSpecError:
        raise
    except (ValueError, ZeroDivisionError) as e:
        raise FlashSpecError(f"head.rank {rank!r} is not an int or 'd/N' with N > 0; "
                             "try head.rank=d/8") from e


def resolve_keep(keep: int | float | str | None, vocab: int, hidden: int) -> int:
    """Truncation size k: an int, a fraction of V (0.25), or 'match:<rank>' (equal cost to that
    low-rank head, k = r (V + d) / d), e.g. 'match:d/8'."""
    if keep is None:
        raise FlashSpecError("head.kind=truncated needs head.keep (int, fraction of V, or "
                             "'match:d/8')")
    if isinstance(keep, str) and keep.startswith("match:"):
        return equal_cost_keep(resolve_rank(keep.split(":", 1)[1], hidden), vocab, hidden)
    if isinstance(keep, str):
        try:
            keep = float(keep) if any(c in keep for c in ".eE") else int(keep)
        except ValueError as e:
            raise FlashSpecError(f"head.keep {keep!r} is not an int, a fraction or 'match:d/8'") from e
    if isinstance(keep, float):
        if not 0 < keep <= 1:
            raise FlashSpecError(f"head.keep fraction {keep} is outside (0, 1]")
        return max(1, round(keep * vocab))
    if not 0 < int(keep) <= vocab:
        raise FlashSpecError(f"head.keep={keep} is outside [1, V={vocab}]")
    return int(keep)


def build_head(cfg_head: Mapping[str, Any], full_weight: torch.Tensor,
               hidden_size: int | None = None, frequencies: torch.Tensor | None = None,
               always_keep: Iterable[int] = (), calibration: torch.Tensor | None = None) -> Head:
    """The head described by ``cfg_head`` (kind, rank, init, checkpoint, keep, frequencies,
    layout: 'out_in' (nn.Linear storage, default) or 'in_out' (transposed storage).

    ``full_weight`` [V, d] is the drafter's own head. For truncation, token ``frequencies`` [V]
    (measured on target-generated text) come from the argument or the ``frequencies`` file.
    ``init: asvd`` (activation-aware SVD) needs drafter hidden states as ``calibration``.
    The result lives on ``full_weight``'s device and dtype; ``head.describe()`` has the
    resolved rank / keep.
    """
    kind = cfg_head.get("kind", "full") or "full"
    vocab, hidden = full_weight.shape
    if hidden_size is not None and hidden_size != hidden:
        raise FlashSpecError(f"hidden_size={hidden_size} does not match the head weight's d={hidden}")
    if kind not in KINDS:
        raise FlashSpecError(f"head.kind={kind!r} unknown; choose one of {', '.join(KINDS)}")
    layout = cfg_head.get("layout", "out_in") or "out_in"
    if kind == "full":
        head: Head = FullHead(full_weight, layout)
    elif kind == "lowrank":
        head = _lowrank(cfg_head, full_weight, hidden, calibration, layout)
    else:
        head = _truncated(cfg_head, full_weight, frequencies, always_keep, layout)
    head = head.to(device=full_weight.device, dtype=full_weight.dtype)
    log.info("drafter head: %s", head.describe())
    return head


def _path(value: Any) -> Path:
    """A config path: as given if it exists (or is absolute), else relative to the repository."""
    path = Path(str(value)).expanduser()
    if path.is_absolute() or path.exists():
        return path
    return Path(__file__).resolve().parents[2] / path


def _lowrank(cfg: Mapping[str, Any], weight: torch.Tensor, hidden: int,
             calibration: torch.Tensor | None, layout: str) -> LowRankHead:
    rank = resolve_rank(cfg.get("rank"), hidden)
    log.info("head.rank=%s resolves to r=%d (d=%d)", cfg.get("rank"), rank, hidden)
    checkpoint = cfg.get("checkpoint")
    if checkpoint:
        head, meta = load_head(_path(checkpoint), layout=layout)
        if not isinstance(head, LowRankHead) or head.rank != rank:
            raise FlashSpecError(f"checkpoint {checkpoint} holds {meta.get('kind')} rank "
                                 f"{meta.get('rank')}, but head.rank resolves to {rank}")
        if head.vocab_size != weight.shape[0] or head.hidden_size != hidden:
            raise FlashSpecError(f"checkpoint {checkpoint} is for V={head.vocab_size}, "
                                 f"d={head.hidden_size}; the drafter has {tuple(weight.shape)}")
        return head
    init = cfg.get("init", "svd") or "svd"
    if init not in INITS:
        raise FlashSpecError(f"head.init={init!r} unknown; choose one of {', '.join(INITS)} "
                             "or give head.checkpoint")
    if init == "asvd" and calibration is None:
        raise FlashSpecError("head.init=asvd needs calibration hidden states of the drafter; "
                             "pass calibration= or use head.init=svd")
    return LowRankHead.from_svd(weight, rank, calibration if init == "asvd" else None, layout)


def _truncated(cfg: Mapping[str, Any], weight: torch.Tensor, freqs: torch.Tensor | None,
               always_keep: Iterable[int], layout: str) -> TruncatedHead:
    vocab, hidden = weight.shape
    keep = resolve_keep(cfg.get("keep"), vocab, hidden)
    log.info("head.keep=%s resolves to k=%d of V=%d", cfg.get("keep"), keep, vocab)
    if freqs is None:
        path = cfg.get("frequencies")
        if not path:
            raise FlashSpecError("head.kind=truncated needs token frequencies: pass them or set "
                                 "head.frequencies to a file from `python scripts/distill_head.py`")
        freqs, _ = load_frequencies(_path(path))
    extra = list(always_keep) + list(cfg.get("always_keep") or [])
    return TruncatedHead.from_frequencies(weight, freqs.cpu(), keep, always_keep=extra,
                                          layout=layout)
