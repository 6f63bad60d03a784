"""Drafter LM heads: full ``z = W h``, low-rank ``z = W_up (W_down h)`` (SlimSpec) and static
vocabulary truncation (VocabTrim / FR-Spec style baseline).

Every head maps hidden states ``h [..., d]`` to full-vocabulary logits ``[..., V]``, so the
drafter's q is exactly what the head produced and the verifier stays exact. The truncated
head writes -inf outside its kept ids: those tokens have q = 0 and can never be drafted.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import nn

from flashspec.errors import FlashSpecError
from flashspec.kernels import choose
from flashspec.matmul import linear
from flashspec.options import KernelOptions


LAYOUTS = ("out_in", "in_out")


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A weight [out, in] stored row-major ('out_in', nn.Linear's layout) or column-major
    ('in_out': the [in, out] transpose is contiguous). Same values and shape either way; the
    storage picks the GEMM/GEMV kernel (on CPU, 'in_out' is much faster at small batch for
    skinny matrices). No copy when ``t`` already has the layout."""
    if layout == "out_in":
        return t.contiguous()
    if layout == "in_out":
        return t.T.contiguous().T
    raise FlashSpecError(f"head.layout={layout!r} unknown; choose one of {', '.join(LAYOUTS)}")


def layout_of(t: torch.Tensor) -> str:
    return "in_out" if t.dim() == 2 and t.T.is_contiguous() and not t.is_contiguous() else "out_in"


class FullHead(nn.Module):
    """The drafter's own head: logits = h W^T with W [V, d]."""

    kind = "full"

    def __init__(self, weight: torch.Tensor, layout: str = "out_in") -> None:
        super().__init__()
        if weight.dim() != 2:
            raise FlashSpecError(f"head weight must be [V, d], got shape {tuple(weight.shape)}")
        # shares storage with ``weight`` (e.g. tied embeddings) when it already has the layout
        self.weight = nn.Parameter(laid_out(weight.detach(), layout), requires_grad=False)

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return linear(h, self.weight)

    def weight_bytes(self) -> int:
        """Bytes of weight read per call."""
        return _bytes(self.weight)

    def flops_per_token(self) -> int:
        """Multiply-adds x 2 per hidden vector."""
        return 2 * self.vocab_size * self.hidden_size

    def describe(self) -> dict:
        return {"kind": self.kind, "rank": None, "keep": None, "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size, "weight_bytes": self.weight_bytes(),
                "flops_per_token": self.flops_per_token(), "layout": layout_of(self.weight)}


# a LowRankHead carries KernelOptions.head_triton as its ``use_triton`` (heads/choice.py sets it)
_HEAD_OPTIONS = {flag: KernelOptions(head_triton=flag) for flag in (False, True)}


class LowRankHead(nn.Module):
    """SlimSpec head: logits = (h W_down^T) W_up^T, W_down [r, d], W_up [V, r]; dense matmuls.

    Opt in (``use_triton=True``, from ``KernelOptions.head_triton``): on CUDA with at most 16
    rows and no autograd, the up projection (small r, huge V) runs a Triton kernel
    (:mod:`flashspec.heads.triton_head`) instead of cuBLAS. Off by default: it beats cuBLAS at
    the 128k-152k vocabularies (Qwen2.5, Llama-3.1) but not at SmolLM2's (V = 49,152) ranks 36
    and 72 (RESULTS.md, experiment=head_bench), so a large-vocabulary target's run turns it on.
    """

    kind = "lowrank"

    def __init__(self, w_down: torch.Tensor, w_up: torch.Tensor, layout: str = "out_in",
                 use_triton: bool = False) -> None:
        super().__init__()
        self.use_triton = use_triton
        if w_down.dim() != 2 or w_up.dim() != 2 or w_down.shape[0] != w_up.shape[1]:
            raise FlashSpecError(f"low-rank head needs w_down [r, d] and w_up [V, r]; got "
                                 f"{tuple(w_down.shape)} and {tuple(w_up.shape)}")
        check_rank(w_down.shape[0], w_down.shape[1])
        # shares storage with arguments already in ``layout``; the layout picks the GEMM path
        self.w_down = nn.Parameter(laid_out(w_down.detach(), layout))
        self.w_up = nn.Parameter(laid_out(w_up.detach(), layout))

    @classmethod
    def from_svd(cls, weight: torch.Tensor, rank: int, calibration: torch.Tensor | None = None,
                 layout: str = "out_in", use_triton: bool = False) -> "LowRankHead":
        """Training-free init from a truncated SVD of the full head W [V, d].

        Without ``calibration`` this is the best rank-r approximation of W (Eckart-Young).
        With calibration hidden states X [N, d] it is activation-aware: the rank-r Ŵ that
        minimises E_h ||(W - Ŵ) h||^2 over those states, via the SVD of W L, C = X^T X / N = L L^T.
        The singular values are split evenly (sqrt) between the two factors.
        """
        check_rank(rank, weight.shape[1])
        w = weight.detach().double()
        if calibration is None:
            u, s, vh = torch.linalg.svd(w, full_matrices=False)
        else:
            chol = _cholesky(calibration.detach().to(w.device).double().reshape(-1, w.shape[1]))
            u, s, vh = torch.linalg.svd(w @ chol, full_matrices=False)
            vh = torch.linalg.solve_triangular(chol, vh, upper=False, left=False)
        root = s[:rank].sqrt()
        w_up = (u[:, :rank] * root).to(weight.dtype)
        w_down = (root[:, None] * vh[:rank]).to(weight.dtype)
        return cls(w_down, w_up, layout, use_triton)

    @property
    def rank(self) -> int:
        return self.w_down.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.w_up.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w_down.shape[1]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        u = linear(h, self.w_down)
        if choose("head_up", u, _HEAD_OPTIONS[bool(self.use_triton)], weight=self.w_up).triton:
            from flashspec.heads import triton_head  # lazy: triton only where CUDA runs it
            return triton_head.skinny_matmul(u, self.w_up)
        return linear(u, self.w_up)

    def weight_bytes(self) -> int:
        return _bytes(self.w_down, self.w_up)

    def flops_per_token(self) -> int:
        return 2 * self.rank * (self.hidden_size + self.vocab_size)

    def describe(self) -> dict:
        return {"kind": self.kind, "rank": self.rank, "keep": None, "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size, "weight_bytes": self.weight_bytes(),
                "flops_per_token": self.flops_per_token(), "layout": layout_of(self.w_up)}


class TruncatedHead(nn.Module):
    """Static top-k vocabulary: logits only for ``keep_ids``, -inf for every other id.

    ``weight`` is the full head [V, d] (or, with ``kept_rows=True``, only the kept rows
    [k, d] in ``keep_ids`` order); only the kept rows are stored. ``forward_kept`` returns
    the k kept logits alone (column i is token ``keep_ids[i]``).
    """

    kind = "truncated"

    def __init__(self, weight: torch.Tensor, keep_ids: Sequence[int] | torch.Tensor,
                 vocab_size: int | None = None, *, kept_rows: bool = False,
                 layout: str = "out_in") -> None:
        super().__init__()
        vocab = int(vocab_size if vocab_size is not None else weight.shape[0])
        ids = torch.as_tensor(keep_ids, dtype=torch.long, device=weight.device).flatten()
        _check_keep_ids(ids, vocab)
        expected = ids.numel() if kept_rows else vocab
        if weight.dim() != 2 or weight.shape[0] != expected:
            raise FlashSpecError(f"truncated head weight has shape {tuple(weight.shape)}; "
                                 f"expected [{expected}, d]")
        rows = weight if kept_rows else weight[ids]
        self.weight = nn.Parameter(laid_out(rows.detach(), layout), requires_grad=False)
        self.register_buffer("keep_ids", ids.clone())
        self._vocab = vocab

    @classmethod
    def from_frequencies(cls, weight: torch.Tensor, freqs: torch.Tensor, k: int,
                         always_keep: Iterable[int] = (), layout: str = "out_in"
                         ) -> "TruncatedHead":
        """Keep the k most frequent ids (ties: lower id first), plus ``always_keep`` (e.g. EOS)."""
        vocab = weight.shape[0]
        if freqs.numel() != vocab:
            raise FlashSpecError(f"frequencies cover {freqs.numel()} ids but the head has V={vocab}")
        ids = top_ids(freqs, k, always_keep)
        return cls(weight, ids, vocab, layout=layout)

    @property
    def keep(self) -> int:
        return self.keep_ids.numel()

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    def forward_kept(self, h: torch.Tensor) -> torch.Tensor:
        return linear(h, self.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        kept = self.forward_kept(h)
        out = kept.new_full((*kept.shape[:-1], self._vocab), float("-inf"))
        return out.index_copy_(-1, self.keep_ids, kept)

    def weight_bytes(self) -> int:
        """Bytes of the kept weight rows (the int64 id list, 8k bytes, is not counted)."""
        return _bytes(self.weight)

    def flops_per_token(self) -> int:
        return 2 * self.keep * self.hidden_size

    def describe(self) -> dict:
        return {"kind": self.kind, "rank": None, "keep": self.keep, "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size, "weight_bytes": self.weight_bytes(),
                "flops_per_token": self.flops_per_token(), "layout": layout_of(self.weight)}


Head = FullHead | LowRankHead | TruncatedHead


def check_rank(rank: int, hidden: int) -> int:
    """A rank must lie in [1, d]."""
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 < rank <= hidden:
        raise FlashSpecError(f"low-rank head rank {rank!r} is outside [1, d={hidden}]; "
                             "pick e.g. head.rank=d/8")
    return rank


def _cholesky(x: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factor of the second moment X^T X / N, ridge-regularised to be definite."""
    if x.shape[0] == 0:
        raise FlashSpecError("activation-aware SVD needs at least one calibration hidden state")
    c = x.T @ x / x.shape[0]
    ridge = 1e-6 * float(c.diagonal().mean()) + 1e-12
    return torch.linalg.cholesky(c + ridge * torch.eye(c.shape[0], dtype=c.dtype, device=c.device))


def _check_keep_ids(ids: torch.Tensor, vocab: int) -> None:
    if ids.numel() == 0:
        raise FlashSpecError("truncated head keeps no token; set head.keep >= 1")
    if ids.min() < 0 or ids.max() >= vocab:
        raise FlashSpecError(f"truncated head keep ids must lie in [0, V={vocab})")
    if ids.unique().numel() != ids.numel():
        raise FlashSpecError("truncated head keep ids contain duplicates")


def token_frequencies(token_id_tensors: Iterable[torch.Tensor | Sequence[int]], vocab: int
                      ) -> torch.Tensor:
    """Counts [V] (int64) of token ids over an iterable of id tensors or lists."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for ids in token_id_tensors:
        t = torch.as_tensor(ids, dtype=torch.long).flatten().cpu()
        t = t[t >= 0]  # -1 is padding in verify outputs
        if t.numel() and int(t.max()) >= vocab:
            raise FlashSpecError(f"token id {int(t.max())} is outside the vocabulary V={vocab}")
        counts += torch.bincount(t, minlength=vocab)
    return counts


def top_ids(freqs: torch.Tensor, k: int, always_keep: Iterable[int] = ()) -> torch.Tensor:
    """The k most frequent ids, sorted ascending; ties go to the lower id; ``always_keep`` first."""
    vocab = freqs.numel()
    if not 0 < k <= vocab:
        raise FlashSpecError(f"truncation size k={k} is outside [1, V={vocab}]")
    forced = torch.as_tensor(sorted(set(int(i) for i in always_keep)), dtype=torch.long)
    if forced.numel() > k:
        raise FlashSpecError(f"always_keep has {forced.numel()} ids but k={k}")
    score = freqs.detach().double().cpu().clone()
    score[forced] = float("inf")
    order = torch.sort(-score, stable=True).indices
    return order[:k].sort().values
