"""The values every layer of flashspec shares: sampling settings, arms, draft-tree shapes and
drafted trees, and the attention layout of a tree step.

This module sits at the bottom of the import graph (torch, the standard library and
:mod:`flashspec.errors` only; ``tests/test_imports.py`` holds it there), so that the verifiers,
the models, the drafters and the decode loop can all take these types without importing each
other: a model accepts a :class:`TreeAttention` without knowing how a tree is grown, a verifier
takes a :class:`TreeDraft` without knowing who drafted it.

A tree draft of row b is ``N + 1`` nodes: node 0 is the root (the row's last committed token,
fed to the target as in a chain step) and nodes 1..N are drafted tokens; ``parents[b, i] < i``
(topological order) and siblings come in the drafter's priority order. In the target's step the
node i sits at RoPE position ``L - 1 + depth[i]`` and in cache slot ``L - 1 + i`` (L the row's
committed length) and attends the committed prefix and its own ancestors (:mod:`flashspec.tree`
grows trees and moves the accepted path into place).
"""
from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Sequence

import torch

from flashspec.errors import FlashSpecError

# Smallest non-zero temperature. The warp divides float32 logits by T (both the torch path and
# the Triton kernels, whatever the model dtype: bf16/fp16 logits are upcast first); below ~1e-36
# T itself is subnormal and logits/T overflows to inf, turning softmax into NaN. With T >= 1e-4 a
# logit as large as 1e4 becomes 1e8 (float32 max 3.4e38): always finite. Distributions at
# T < 1e-4 are one-hot in all but exact ties anyway, so smaller values are refused: use 0.
T_MIN = 1e-4


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 disable those warps."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if not _real(t) or not (t == 0 or T_MIN <= t < math.inf):
            raise FlashSpecError(f"temperature must be 0 (greedy) or a finite number >= {T_MIN}, "
                                 f"got {t!r}; use 0 for greedy decoding")
        if not _real(p) or not 0 < p <= 1:
            raise FlashSpecError(f"top_p must be in (0, 1], got {p!r}; use 1.0 to disable")
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise FlashSpecError(f"top_k must be an integer >= 0, got {k!r}; use 0 to disable")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _real(x: object) -> bool:
    """A real number, not a bool (True would pass as 1) and not NaN."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)


MAX_NODES = 64
NODE_STREAMS = 1024     # counter-based child draws: stream row * NODE_STREAMS + parent node id


@dataclass(frozen=True)
class TreeShape:
    """``branching`` (static: children per node at each depth) or ``nodes`` (dynamic: the node
    budget, expanded ``top_k`` nodes at a time to ``depth`` levels)."""

    branching: tuple[int, ...] = ()
    nodes: int = 0
    depth: int = 0
    top_k: int = 0

    def __post_init__(self) -> None:
        if bool(self.branching) == bool(self.nodes):
            raise FlashSpecError("a tree shape is static (branching) or dynamic (nodes), not both")
        if self.branching and min(self.branching) < 1:
            raise FlashSpecError(f"tree branching must be >= 1 per depth, got {self.branching}")
        if self.nodes and not (self.depth >= 1 and self.top_k >= 1 and self.nodes >= self.depth):
            raise FlashSpecError(f"dynamic tree needs depth >= 1, top_k >= 1 and nodes >= depth; "
                                 f"got nodes={self.nodes} depth={self.depth} top_k={self.top_k}")
        if self.size > MAX_NODES:
            raise FlashSpecError(f"tree of {self.size} nodes; at most {MAX_NODES}")
        if self.candidates >= NODE_STREAMS:
            raise FlashSpecError(f"tree drafts {self.candidates} candidates; at most "
                                 f"{NODE_STREAMS - 1}")

    @classmethod
    def parse(cls, spec: str) -> "TreeShape":
        """``"4x2x1"`` (static) or ``"dyn15"`` / ``"dyn15d6k4"`` (dynamic; depth 6, top-k 4 by
        default: depth and top_k cap what the N nodes may reach)."""
        text = str(spec).strip().lower()
        if m := re.fullmatch(r"dyn(\d+)(?:d(\d+))?(?:k(\d+))?", text):
            n = int(m.group(1))
            return cls(nodes=n, depth=int(m.group(2) or min(6, n)), top_k=int(m.group(3) or 4))
        if re.fullmatch(r"\d+(x\d+)*", text):
            return cls(branching=tuple(int(k) for k in text.split("x")))
        raise FlashSpecError(f"tree shape {spec!r}: write branching per depth ('4x2x1') or a "
                             "dynamic node budget ('dyn15', 'dyn15d6k4')")

    @property
    def size(self) -> int:
        """Drafted nodes N (the root not counted); the verify width is N + 1."""
        if self.nodes:
            return self.nodes
        return sum(math.prod(self.branching[:d + 1]) for d in range(len(self.branching)))

    @property
    def candidates(self) -> int:
        """Nodes drafted before the dynamic selection keeps ``nodes`` of them (static: N)."""
        if self.nodes:
            return self.top_k + (self.depth - 1) * self.top_k ** 2
        return self.size

    @property
    def max_depth(self) -> int:
        """The longest path: most drafts one step can accept."""
        return self.depth if self.nodes else len(self.branching)

    @property
    def label(self) -> str:
        if self.nodes:
            return f"dyn{self.nodes}d{self.depth}k{self.top_k}"
        return "x".join(str(k) for k in self.branching)


@dataclass
class TreeDraft:
    """The drafted trees of a batch: ``tokens``, ``parents``, ``depth`` [B, N + 1] (node 0 the
    root: the last committed token, parent -1, depth 0). ``logits`` [B, N + 1, V]: the raw draft
    logits at each node when its children were sampled from them without replacement (in
    sibling order); None when children were chosen deterministically (one-hot drafts).
    ``bits``: :meth:`ancestor_bits` when the drafting already built them (else derived).
    ``fanout``: the most children any node may have (from the tree's shape; 0: unknown, up to
    N), a bound the fused verify sizes its launches by without reading the parents."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    logits: torch.Tensor | None = None
    bits: torch.Tensor | None = field(default=None, repr=False)
    fanout: int = 0

    @property
    def size(self) -> int:
        return self.tokens.shape[1] - 1

    def ancestor_bits(self) -> torch.Tensor:
        """[B, N + 1, W] int64 (:func:`pack_bits` of :meth:`ancestors`)."""
        return self.bits if self.bits is not None else pack_bits(self.ancestors())

    def ancestors(self) -> torch.Tensor:
        """[B, N + 1, N + 1] bool: ``[b, i, j]`` when node j is node i or one of its ancestors."""
        batch, n = self.parents.shape
        if self.bits is not None:
            return unpack_bits(self.bits, n)
        anc = torch.eye(n, dtype=torch.bool, device=self.parents.device).repeat(batch, 1, 1)
        rows = torch.arange(batch, device=self.parents.device)
        for i in range(1, n):     # parents come first: their rows are complete
            anc[:, i] |= anc[rows, self.parents[:, i].clamp(min=0)]
        return anc

    def most_children(self) -> int:
        """The most children any node has: ``fanout`` when the shape gave it, else read from
        the parents (a host read)."""
        if self.fanout:
            return self.fanout
        kids = torch.zeros(self.parents.shape, dtype=torch.long, device=self.parents.device)
        kids.scatter_add_(1, self.parents.clamp(min=0), (self.parents >= 0).long())
        return int(kids.max())

    def children(self) -> torch.Tensor:
        """[B, N + 1, K] node ids of each node's children in priority order, -1 padded."""
        batch, n = self.parents.shape
        par = self.parents
        same = par[:, :, None] == par[:, None, :]                          # [B, N+1, N+1]
        earlier = torch.ones(n, n, dtype=torch.bool, device=par.device).tril(-1)
        rank = (same & earlier).sum(-1)                                     # siblings before i
        k = max(1, self.most_children())
        kids = torch.full((batch, n + 1, k), -1, dtype=torch.long, device=par.device)
        ids = torch.arange(n, device=par.device).expand(batch, n)
        parent = torch.where(par >= 0, par, torch.full_like(par, n))       # the root goes to a dump row
        kids[torch.arange(batch, device=par.device)[:, None], parent, rank.clamp(max=k - 1)] = ids
        return kids[:, :n]


def tree_mask(ancestors: torch.Tensor, lengths: torch.Tensor, span: int) -> torch.Tensor:
    """Attention mask [B, 1, q, span] of q query nodes (``ancestors`` [B, q, N + 1], the rows of
    :meth:`TreeDraft.ancestors` of the queries): node i sees the committed prefix (slots < L - 1) and
    the slots of its ancestors and itself (slot L - 1 + j for node j)."""
    slot = torch.arange(span, device=lengths.device)
    base = (lengths - 1)[:, None]                                   # [B, 1]
    prefix = slot[None] < base                                      # [B, span]
    col = slot[None] - base                                         # node id of a tree slot
    queries, n = ancestors.shape[1:]
    inside = (col >= 0) & (col < n)
    tree = ancestors.gather(2, col.clamp(0, n - 1)[:, None].expand(-1, queries, -1))  # [B, q, span]
    return (prefix[:, None] | (inside[:, None] & tree))[:, None]


def pack_bits(ancestors: torch.Tensor) -> torch.Tensor:
    """Bool [..., n] -> int64 words [..., ceil(n / 64)]: bit j of word j // 64 for column j."""
    *lead, width = ancestors.shape
    words = -(-width // 64)
    padded = torch.nn.functional.pad(ancestors, (0, 64 * words - width))
    shifts = torch.arange(64, device=ancestors.device)
    # distinct bits: the sum is their OR (bit 63 wraps to the sign bit, still that bit)
    return (padded.view(*lead, words, 64).long() << shifts).sum(-1)


def unpack_bits(bits: torch.Tensor, width: int) -> torch.Tensor:
    """The inverse of :func:`pack_bits`: int64 words [..., W] -> bool [..., width]."""
    cols = torch.arange(width, device=bits.device)
    return ((bits[..., cols // 64] >> (cols % 64)) & 1).bool()


@dataclass(frozen=True)
class TreeAttention:
    """How draft-tree nodes attend in a step: queries at cache ``slots`` [B, q] with ancestor
    bitmasks ``bits`` [B, q, W] (bit j: tree node j, at slot ``base + j``, is the query or one
    of its ancestors), rows of committed ``lengths`` [B], keys up to ``span``; ``base`` [B]: the
    root's slot, lengths - 1 (derived when not given). The fused decode layers read ``bits``
    and ``base``, the reference layers ``mask`` (built on first use)."""

    slots: torch.Tensor
    bits: torch.Tensor
    lengths: torch.Tensor
    span: int
    base: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.base is None:
            object.__setattr__(self, "base", self.lengths - 1)

    @cached_property
    def mask(self) -> torch.Tensor:
        """[B, 1, q, span] bool (:func:`tree_mask`)."""
        return tree_mask(unpack_bits(self.bits, 64 * self.bits.shape[-1]), self.lengths,
                         self.span)

    @cached_property
    def path(self) -> torch.Tensor:
        """[B, q, 1 + 64 W] int32 (:func:`path_table`): each query's path length, then its path.
        The fused layers fill this from their own kernel on first use, once per step, so the
        attention calls of every layer of one step share it."""
        return path_table(self.bits)


def path_table(bits: torch.Tensor) -> torch.Tensor:
    """[..., 1 + 64 W] int32 of ancestor bitmasks ``bits`` [..., W]: entry 0 is the number of set
    bits (the path's length, the node included), entry k >= 1 the k-th set bit's node id (the
    path root first, as parents precede children), unused entries 0."""
    width = 64 * bits.shape[-1]
    on = unpack_bits(bits, width)
    rank = on.to(torch.int32).cumsum(-1)
    # set bit j goes to entry rank(j); clear bits go to a spill column cut off below
    index = torch.where(on, rank, width + 1).long()
    nodes = torch.arange(width, device=bits.device, dtype=torch.int32).expand_as(rank)
    table = torch.zeros(*bits.shape[:-1], width + 2, dtype=torch.int32, device=bits.device)
    table.scatter_(-1, index, nodes)
    table[..., 0] = rank[..., -1]
    return table[..., :width + 1]


@dataclass(frozen=True)
class Arm:
    """One choice a policy can make, as a value: a drafter's name (None: no speculation, a plain
    target step) with γ drafts per step, or with a draft ``tree`` (γ is then the tree's depth:
    the most drafts one step can accept). The engine, the resident loop, policies, the planner,
    records and plots all name an arm this way (the engine finds the drafter by its name), and
    :attr:`label` is how records and configs spell it: ``ar``, ``<drafter>@<γ>``,
    ``<drafter>@<tree label>``."""

    drafter: str | None = None
    gamma: int = 0
    tree: TreeShape | None = None

    def __post_init__(self) -> None:
        g = self.gamma
        if isinstance(g, bool) or not isinstance(g, numbers.Integral) or g < 0:
            raise FlashSpecError(f"gamma must be an int >= 0, got {g!r}")
        object.__setattr__(self, "gamma", int(g))
        if self.drafter == "ar":
            raise FlashSpecError("'ar' names the arm without a drafter: write Arm() (or 'ar')")
        if self.tree is not None:
            if self.drafter is None:
                raise FlashSpecError(f"a draft tree ({self.tree.label}) needs a drafter")
            if g not in (0, self.tree.max_depth):
                raise FlashSpecError(f"tree {self.tree.label} has depth {self.tree.max_depth}, "
                                     f"not gamma {g}")
            object.__setattr__(self, "gamma", self.tree.max_depth)
        elif self.drafter is not None and g == 0:
            raise FlashSpecError(f"gamma must be >= 1 for a drafter, got {g} for {self.drafter!r}")
        elif self.drafter is None and g:
            raise FlashSpecError(f"gamma {g} without a drafter: nothing drafts (Arm() is plain)")

    @classmethod
    def parse(cls, spec: Arm | str | Sequence[Any]) -> Arm:
        """An arm from a config's forms: a label (``"ar"``, ``"ngram@3"``,
        ``"eagle_lr72@dyn3d3k2"``) or a pair ``[drafter, γ or tree]`` (``[ngram, 3]``,
        ``[eagle_lr72, dyn15]``: a tree as :meth:`TreeShape.parse` reads it; ``[ar, 0]``)."""
        if isinstance(spec, Arm):
            return spec
        if isinstance(spec, str):
            if spec.strip() == "ar":
                return cls()
            name, sep, how = spec.strip().rpartition("@")
            if not sep or not name:
                raise FlashSpecError(f"arm {spec!r}: write 'ar' or '<drafter>@<gamma or tree>'")
        elif isinstance(spec, Sequence) and len(spec) == 2:
            name, how = spec
        else:
            raise FlashSpecError(f"{spec!r} is not a [drafter, gamma or tree] pair")
        name = str(name)
        if isinstance(how, TreeShape):
            return cls(name, tree=how)
        if isinstance(how, str) and how.strip().isdigit():
            how = int(how)
        if isinstance(how, bool) or (isinstance(how, float) and not how.is_integer()):
            raise FlashSpecError(f"{how!r} for drafter {name!r} is not a gamma (a positive int) "
                                 "nor a tree shape")
        if isinstance(how, float):   # 3.0 is read exactly as 3
            how = int(how)
        if isinstance(how, numbers.Integral):
            if name == "ar":   # the plain arm drafts nothing: its γ is read as 0, as it always was
                return cls()
            if how <= 0:
                raise FlashSpecError(f"gamma must be a positive int, got {how} for drafter {name!r}")
            return cls(name, int(how))
        return cls(name, tree=TreeShape.parse(str(how)))

    @property
    def label(self) -> str:
        """``ar``, ``<drafter>@<γ>`` or ``<drafter>@<tree label>``: the one spelling in records,
        metrics, plots and configs (:meth:`parse` reads it back)."""
        if self.drafter is None:
            return "ar"
        return f"{self.drafter}@{self.tree.label if self.tree is not None else self.gamma}"

    def __str__(self) -> str:
        return self.label

    @property
    def drafts(self) -> bool:
        """Whether a step of this arm drafts (the plain arm does not)."""
        return self.drafter is not None

    @property
    def reach(self) -> int:
        """Cache slots a step may write beyond the committed length (γ, or the tree's nodes)."""
        return self.tree.candidates if self.tree is not None else self.gamma
