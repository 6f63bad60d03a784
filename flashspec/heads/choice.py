"""Which drafter head to use: ``head=full | lowrank | truncated`` as small frozen choices.

A choice is what ``conf/head/*.yaml`` instantiates to; a drafter builder calls
``choice.build(full_weight, trained)`` with its own full head weight [V, d] and the trained
low-rank heads it knows (rank -> head). Contradictory settings fail when the choice is made,
before any model loads: ``head=full head.rank=d/8`` names both keys.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from flashspec.errors import FlashSpecError
from flashspec.heads.io import load_frequencies, load_head
from flashspec.heads.modules import LAYOUTS, Head, LowRankHead, TruncatedHead
from flashspec.paths import repo_path
from flashspec.theory import equal_cost_keep

log = logging.getLogger(__name__)

INITS = ("trained", "svd", "asvd")


def resolve_rank(rank: int | str | None, hidden: int) -> int:
    """A head rank written as an int or a fraction of d ('72', 'd/8', '3d/4') as an int in (0, d]."""
    if rank is None or isinstance(rank, bool):
        raise FlashSpecError(f"head.rank {rank!r} is not an int or 'd/N'; try head.rank=d/8")
    text = str(rank).replace(" ", "")
    try:
        if "d" not in text:
            value = int(text)
        else:
            num, _, den = text.partition("/")
            if not num.endswith("d"):
                raise ValueError(text)
            value = hidden * int(num[:-1] or 1) // int(den or 1)
    except (ValueError, ZeroDivisionError) as e:
        raise FlashSpecError(f"head.rank {rank!r} is not an int or 'd/N' with N > 0; "
                             "try head.rank=d/8") from e
    if not 0 < value <= hidden:
        raise FlashSpecError(f"head.rank {rank!r} resolves to {value}, outside (0, d={hidden}]; "
                             "pick a rank between 1 and the drafter's hidden size")
    return value


def resolve_keep(keep: int | float | str | None, vocab: int, hidden: int) -> int:
    """Truncation size k: an int, a fraction of V (0.25), or 'match:<rank>' (equal cost to that
    low-rank head, k = r (V + d) / d), e.g. 'match:d/8'."""
    if keep is None:
        raise FlashSpecError("head=truncated needs head.keep (int, fraction of V, or 'match:d/8')")
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


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise FlashSpecError(f"head.layout={layout!r} unknown; choose one of {', '.join(LAYOUTS)}")


def _check_rank_syntax(rank: int | str) -> None:
    """Refuse a malformed rank now (the value against d is checked when d is known)."""
    resolve_rank(rank, hidden=1 << 30)


@dataclass(frozen=True)
class FullHeadChoice:
    """``head=full``: the drafter's own full head ``z = W h``. It has no rank: setting one is
    a contradiction, refused with both keys named."""

    rank: int | str | None = None
    kind: str = field(default="full", init=False)

    def __post_init__(self) -> None:
        if self.rank is not None:
            raise FlashSpecError(f"head=full has no rank, but head.rank={self.rank} was set; use "
                                 f"head=lowrank head.rank={self.rank} for a low-rank head")

    def build(self, weight: torch.Tensor, trained: Mapping[int, Head] | None = None,
              drafter: str = "drafter", use_triton: bool = False) -> None:
        """None: the drafter keeps its own full head."""
        return None


@dataclass(frozen=True)
class LowRankChoice:
    """``head=lowrank``: ``z = W_up W_down h`` of rank ``rank`` (int or 'd/N').

    ``init``: ``trained`` takes the drafter's trained head of that rank (a clear error when the
    drafter has none), ``svd`` / ``asvd`` a training-free (activation-aware) SVD of the full
    head; ``checkpoint`` a head file from ``scripts/distill_head.py`` (wins over ``init``).
    """

    rank: int | str = "d/8"
    init: str = "trained"
    checkpoint: str | None = None
    layout: str = "out_in"
    kind: str = field(default="lowrank", init=False)

    def __post_init__(self) -> None:
        _check_rank_syntax(self.rank)
        _check_layout(self.layout)
        if self.init not in INITS:
            raise FlashSpecError(f"head.init={self.init!r} unknown; choose one of {', '.join(INITS)}")

    def build(self, weight: torch.Tensor, trained: Mapping[int, Head] | None = None,
              drafter: str = "drafter", use_triton: bool = False,
              calibration: torch.Tensor | None = None) -> LowRankHead:
        """The head for a drafter whose own full head is ``weight`` [V, d]; ``use_triton``:
        the up projection through the Triton kernel on CUDA (``KernelOptions.head_triton``)."""
        vocab, hidden = weight.shape
        rank = resolve_rank(self.rank, hidden)
        log.info("head.rank=%s resolves to r=%d (d=%d)", self.rank, rank, hidden)
        if self.checkpoint:
            head, meta = load_head(repo_path(self.checkpoint), layout=self.layout)
            if not isinstance(head, LowRankHead) or head.rank != rank:
                raise FlashSpecError(f"head.checkpoint {self.checkpoint} holds {meta.get('kind')} rank "
                                     f"{meta.get('rank')}, but head.rank={self.rank} resolves to {rank}")
            if head.vocab_size != vocab or head.hidden_size != hidden:
                raise FlashSpecError(f"head.checkpoint {self.checkpoint} is for V={head.vocab_size}, "
                                     f"d={head.hidden_size}; drafter {drafter!r} has {tuple(weight.shape)}")
        elif self.init == "trained":
            known = dict(trained or {})
            if rank not in known:
                have = ", ".join(str(r) for r in sorted(known)) or "none"
                raise FlashSpecError(
                    f"head=lowrank head.rank={self.rank} (r={rank}): drafter {drafter!r} has no "
                    f"trained head of that rank (trained ranks: {have}); pick one of those, or "
                    "head.init=svd for a training-free head, or head.checkpoint=<file>")
            head = known[rank]
        elif self.init == "asvd" and calibration is None:
            raise FlashSpecError("head.init=asvd needs calibration hidden states of the drafter; "
                                 "use head.init=svd")
        else:
            head = LowRankHead.from_svd(weight, rank, calibration if self.init == "asvd" else None,
                                        self.layout)
        head.use_triton = use_triton
        return head.to(device=weight.device, dtype=weight.dtype)


@dataclass(frozen=True)
class TruncatedChoice:
    """``head=truncated``: logits only for the ``keep`` most frequent tokens of target text
    (VocabTrim / FR-Spec baseline), -inf elsewhere, so q stays exact. ``keep``: an int, a
    fraction of V, or 'match:<rank>' (equal cost to that low-rank head)."""

    keep: int | float | str = "match:d/8"
    frequencies: str | None = None
    always_keep: Sequence[int] = ()
    layout: str = "out_in"
    rank: int | str | None = None
    kind: str = field(default="truncated", init=False)

    def __post_init__(self) -> None:
        if self.rank is not None:
            raise FlashSpecError(f"head=truncated has no rank, but head.rank={self.rank} was set; "
                                 f"size it with head.keep (e.g. head.keep=match:{self.rank})")
        _check_layout(self.layout)
        if isinstance(self.keep, str) and self.keep.startswith("match:"):
            _check_rank_syntax(self.keep.split(":", 1)[1])

    def build(self, weight: torch.Tensor, trained: Mapping[int, Head] | None = None,
              drafter: str = "drafter", use_triton: bool = False,
              frequencies: torch.Tensor | None = None,
              always_keep: Sequence[int] = ()
              ) -> TruncatedHead:
        vocab, hidden = weight.shape
        keep = resolve_keep(self.keep, vocab, hidden)
        log.info("head.keep=%s resolves to k=%d of V=%d", self.keep, keep, vocab)
        if frequencies is None:
            if not self.frequencies:
                raise FlashSpecError("head=truncated needs token frequencies: set head.frequencies "
                                     "to a file from `python scripts/distill_head.py`")
            frequencies, _ = load_frequencies(repo_path(self.frequencies))
        head = TruncatedHead.from_frequencies(weight, frequencies.cpu(), keep,
                                              always_keep=[*always_keep, *self.always_keep],
                                              layout=self.layout)
        return head.to(device=weight.device, dtype=weight.dtype)


HeadChoice = FullHeadChoice | LowRankChoice | TruncatedChoice
