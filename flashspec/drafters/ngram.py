"""Prompt-lookup (n-gram) drafting: copy what followed the latest earlier match of the suffix
(a chain), or what followed several earlier matches (a draft tree of one chain per branch)."""
from __future__ import annotations

from typing import Sequence

import torch

from flashspec.core import SamplingParams, TreeDraft, TreeShape
from flashspec.drafters.base import Drafter
from flashspec.errors import FlashSpecError


def lookup(tokens: list[int], gamma: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Continuation (<= gamma tokens) after the most recent earlier occurrence of the longest
    suffix n-gram (max_ngram down to min_ngram); [] when nothing matches."""
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = tokens[n_tok - n:]
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + gamma]
                if follow:
                    return follow
    return []


def _matches(tokens: torch.Tensor, lengths: torch.Tensor, n: int, span: torch.Tensor
             ) -> torch.Tensor:
    """[B, C - n] bool: the row's suffix n-gram occurs at column ``start`` of ``tokens`` [B, C]
    earlier than the suffix itself (start <= L - n - 1, so a continuation follows it)."""
    batch, cap = tokens.shape
    suffix = tokens.gather(1, (lengths[:, None] - n + span[:n]).clamp(min=0))
    match = torch.ones(batch, cap - n, dtype=torch.bool, device=tokens.device)
    for k in range(n):
        match &= tokens[:, k:cap - n + k] == suffix[:, k:k + 1]
    return match & (span[None, :cap - n] <= (lengths - n - 1)[:, None]) & (lengths > n)[:, None]


def device_lookup(tokens: torch.Tensor, lengths: torch.Tensor, gamma: int, max_ngram: int,
                  min_ngram: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`lookup` for every row at once as device ops over the buffer ``tokens`` [B, C]
    holding ``lengths`` [B] committed tokens: (drafts [B, γ], real drafts per row [B]).

    Rows without a match (or with fewer than γ tokens after theirs) are padded by repeating
    their last token; the padding is a deterministic proposal too, so verification stays exact.
    """
    cap = tokens.shape[1]
    span = torch.arange(cap, device=tokens.device)
    follow = torch.full_like(lengths, -1)        # where the chosen continuation starts
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= cap:
            continue
        starts = span[:cap - n]
        latest = torch.where(_matches(tokens, lengths, n, span), starts[None], -1).amax(1)
        follow = torch.where((follow < 0) & (latest >= 0), latest + n, follow)
    real = torch.where(follow >= 0, (lengths - follow).clamp(max=gamma), 0)
    idx = follow.clamp(min=0)[:, None] + span[:gamma]
    last = (lengths - 1)[:, None].expand(-1, gamma)
    idx = torch.where(span[None, :gamma] < real[:, None], idx, last)
    return tokens.gather(1, idx), real


def device_branches(tokens: torch.Tensor, lengths: torch.Tensor, k: int, depth: int,
                    max_ngram: int, min_ngram: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``k`` continuations of every row as device ops over ``tokens`` [B, C] holding
    ``lengths`` [B] committed tokens: (drafts [B, k, depth], real drafts per branch [B, k]).

    A continuation is what follows an earlier occurrence of a suffix n-gram of the row; they
    are ranked longest n-gram first, then most recent, and a branch takes the best one whose
    first token no better branch starts with (siblings differ). Branch 0 is :func:`lookup`'s
    continuation. Missing tokens (a short continuation, a branch without one) repeat the row's
    last committed token, as :func:`device_lookup` pads: a deterministic proposal too."""
    batch, cap = tokens.shape
    span = torch.arange(cap, device=tokens.device)
    # rank of the continuation starting at column c (-1: none): n * C + c for the longest n
    rank = torch.full((batch, cap), -1, dtype=torch.long, device=tokens.device)
    for n in range(min_ngram, max_ngram + 1):
        if n >= cap:
            continue
        rank[:, n:] = torch.where(_matches(tokens, lengths, n, span),
                                  n * cap + span[None, :cap - n] + n, rank[:, n:])
    first = []
    for _ in range(k):
        best, col = rank.max(1)
        col = torch.where(best >= 0, col, -1)
        first.append(col)
        head = tokens.gather(1, col.clamp(min=0)[:, None])              # the branch's first token
        rank = torch.where((tokens == head) & (col >= 0)[:, None], -1, rank)
    start = torch.stack(first, 1)                                        # [B, k]
    real = torch.where(start >= 0, (lengths[:, None] - start).clamp(max=depth), 0)
    idx = start.clamp(min=0)[..., None] + span[:depth]                   # [B, k, depth]
    last = (lengths - 1)[:, None, None].expand_as(idx)
    idx = torch.where(span[:depth] < real[..., None], idx, last)
    return tokens.gather(1, idx.reshape(batch, -1)).reshape(batch, k, depth), real


def branch_tree(drafts: torch.Tensor, root: torch.Tensor) -> TreeDraft:
    """The draft tree of ``drafts`` [B, k, D] (one chain per branch, from the root tokens
    [B]): nodes breadth first as a static ``k x 1 x ... x 1`` shape numbers them, one-hot."""
    batch, k, depth = drafts.shape
    ids = torch.arange(k * depth, device=drafts.device)
    d = ids // k + 1
    parents = torch.where(d > 1, ids - k + 1, 0)
    return TreeDraft(torch.cat([root[:, None], drafts.transpose(1, 2).reshape(batch, -1)], 1),
                     torch.cat([parents.new_full((1,), -1), parents]).expand(batch, -1),
                     torch.cat([d.new_zeros(1), d]).expand(batch, -1), fanout=k)


class NgramIndex:
    """Incremental :func:`lookup` for one growing token list: O(new tokens) per query.

    ``where[ngram]`` is the start of the continuation after the latest occurrence of ``ngram``
    that has one (an n-gram ending at i is registered once token i + 1 exists), so a query
    returns exactly what :func:`lookup` returns.
    """

    def __init__(self, max_ngram: int, min_ngram: int) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.where: dict[tuple[int, ...], int] = {}
        self.seen = 0   # continuation starts registered so far: 1 .. seen - 1

    def query(self, tokens: list[int], gamma: int) -> list[int]:
        _, c = self.match(tokens)
        return [] if c is None else tokens[c:c + gamma]

    def match(self, tokens: list[int]) -> tuple[int, int | None]:
        """(n, c): the longest suffix n-gram (max_ngram down to min_ngram) with an earlier
        occurrence, and where the continuation after its latest one starts; (0, None) if none."""
        for c in range(max(self.seen, 1), len(tokens)):   # register n-grams ending at c - 1
            for n in range(self.min_ngram, min(self.max_ngram, c) + 1):
                self.where[tuple(tokens[c - n:c])] = c
        self.seen = max(self.seen, len(tokens))
        n_tok = len(tokens)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            c = self.where.get(tuple(tokens[n_tok - n:]))
            if c is not None:
                return n, c
        return 0, None


class NgramDrafter(Drafter):
    """Deterministic proposal (q is one-hot), free to compute, shares the target's tokenizer.
    Its host facts (:class:`flashspec.drafters.base.HostFacts`): whether each live row's suffix
    has an earlier match, from an incremental index per row."""

    one_hot = True      # draft() never returns draft logits
    tree = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, name: str = "ngram") -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.name = max_ngram, min_ngram, name
        self.index: dict[int, tuple[list[int], NgramIndex]] = {}   # row -> (its token list, index)

    def reset(self, batch: int, capacity: int) -> None:
        self.index = {}

    def draft(self, tokens: torch.Tensor, lengths: torch.Tensor, gamma: int,
              params: SamplingParams, seed: torch.Tensor
              ) -> tuple[torch.Tensor, None, torch.Tensor]:
        drafts, real = device_lookup(tokens, lengths, gamma, self.max_ngram, self.min_ngram)
        return drafts, None, real

    def check_tree(self, shape: TreeShape) -> None:
        """The one tree n-gram lookup drafts: ``k x 1 x ... x 1``, a continuation per branch."""
        if not shape.branching or any(b != 1 for b in shape.branching[1:]):
            raise FlashSpecError(f"an n-gram draft tree is one continuation per branch: write "
                                 f"k x 1 x ... x 1 (e.g. 3x1x1x1), not {shape.label}")

    def draft_tree(self, tokens: torch.Tensor, lengths: torch.Tensor, shape: TreeShape,
                   params: SamplingParams, seed: torch.Tensor | None) -> TreeDraft:
        """``k`` continuations of :func:`device_branches` as a tree (one-hot drafts)."""
        self.check_tree(shape)
        drafts, _ = device_branches(tokens, lengths, shape.branching[0], shape.max_depth,
                                    self.max_ngram, self.min_ngram)
        return branch_tree(drafts, tokens.gather(1, (lengths - 1)[:, None])[:, 0])

    def features(self, tokens: Sequence[list[int]], finished: Sequence[bool]
                 ) -> dict[str, object]:
        """``ngram_hit``: whether every live row's suffix has an earlier match to copy from;
        ``ngram_match``: the shortest, over live rows, of the longest such suffix (0 to
        max_ngram). A one-token match is common in any text; a match of max_ngram tokens
        usually means the answer is copying a span, where prompt lookup drafts best."""
        lengths = [self._match(b, toks) for b, (toks, done)
                   in enumerate(zip(tokens, finished)) if not done]
        return {"ngram_hit": bool(lengths) and min(lengths) > 0,
                "ngram_match": min(lengths) if lengths else 0}

    def _match(self, b: int, tokens: list[int]) -> int:
        owner, index = self.index.get(b, (None, None))
        if owner is not tokens or index.seen > len(tokens):   # a new row list: start over
            index = NgramIndex(self.max_ngram, self.min_ngram)
            self.index[b] = (tokens, index)
        return index.match(tokens)[0]
