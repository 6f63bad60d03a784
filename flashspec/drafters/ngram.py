"""Prompt-lookup (n-gram) drafting: copy what followed the latest earlier match of the suffix."""
from __future__ import annotations

import torch

from flashspec.drafters.base import DecodeState, Drafter
from flashspec.verify.sampling import SamplingParams


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


class NgramDrafter(Drafter):
    """Deterministic proposal (q is one-hot), free to compute, shares the target's tokenizer."""

    one_hot = True      # propose() never returns draft logits

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, name: str = "ngram") -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.name = max_ngram, min_ngram, name

    def features(self, state: DecodeState) -> dict[str, object]:
        """``ngram_hit``: whether every live row's suffix has an earlier match to copy from."""
        hits = [bool(lookup(toks, 1, self.max_ngram, self.min_ngram))
                for toks, done in zip(state.host_tokens, state.finished) if not done]
        return {"ngram_hit": bool(hits) and all(hits)}

    def propose(self, state: DecodeState, gamma: int, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[torch.Tensor, None]:
        found = [[] if done else lookup(toks, gamma, self.max_ngram, self.min_ngram)
                 for toks, done in zip(state.host_tokens, state.finished)]
        width = max(len(f) for f in found)
        rows = [f + [f[-1] if f else toks[-1]] * (width - len(f))
                for f, toks in zip(found, state.host_tokens)]
        return torch.tensor(rows, dtype=torch.long, device=state.device).reshape(len(rows), width), None
