"""Drafters that run a native LM: a separate small model, or a layer subset of the target."""
from __future__ import annotations

import torch
from torch import nn

from flashspec.drafters.base import DecodeState, Drafter, GraphedDrafting
from flashspec.models.llama import KVCache, LlamaLM
from flashspec.verify.sampling import SamplingParams, sample


class ModelDrafter(GraphedDrafting, Drafter):
    """Autoregressive drafting with ``model`` restricted to ``layers`` (None: all of them).

    A layer-skip / early-exit self-drafter passes the target itself with a layer subset: the
    weights are shared, the KV cache is the drafter's own. ``head`` replaces the model's LM head
    (low-rank or truncated heads); the logits it returns are what the draft was sampled from.
    """

    def __init__(self, model: LlamaLM, layers: list[int] | None = None, head: nn.Module | None = None,
                 name: str = "model") -> None:
        self.model, self.layers, self.name = model, layers, name
        self.head = head if head is not None else model.lm_head
        self.cache: KVCache | None = None
        self.filled: list[int] = []

    def reset(self, batch: int, capacity: int) -> None:
        if self.cache is None or self.cache.k.shape[1] != batch or self.cache.capacity < capacity:
            self.cache = self.model.new_cache(batch, capacity, self.layers)
            if self.graphs is not None:
                self.graphs.clear()
        self.filled = [0] * batch

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, span: int | None,
              last_idx: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of a window (of its column ``last_idx[b]`` per row when given)."""
        hidden = self.model.forward_hidden(tokens, positions, self.cache, self.layers, span)
        if last_idx is not None:
            hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_idx]
        return self.head(hidden)

    @torch.inference_mode()
    def propose(self, state: DecodeState, gamma: int, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = state.lengths
        width = max(n - f for n, f in zip(lengths, self.filled))
        starts = [max(0, n - width) for n in lengths]
        drafts, logits = self._drafts(state, starts, width, gamma, params, generator)
        self.filled = [n + gamma - 1 for n in lengths]
        return drafts, logits

    def _draft(self, tokens: torch.Tensor, positions: torch.Tensor, last_idx: torch.Tensor,
               last_pos: torch.Tensor, gamma: int, params: SamplingParams,
               generator: torch.Generator | None, seed: torch.Tensor | None, span: int | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Device part of ``propose`` (see :class:`GraphedDrafting`)."""
        logits = self._step(tokens, positions, span, last_idx)
        drafts, draft_logits = [], []
        for i in range(gamma):
            tok = sample(logits, params, generator, seed, i)[0]
            drafts.append(tok)
            draft_logits.append(logits)
            if i + 1 < gamma:
                logits = self._step(tok[:, None], (last_pos + i)[:, None],
                                    None if span is None else span + i + 1)[:, 0]
        return torch.stack(drafts, 1), torch.stack(draft_logits, 1)

    def observe(self, state: DecodeState, n_accepted: list[int]) -> None:
        # positions up to the last accepted draft are valid; the correction token is not fed yet
        self.filled = [min(f, n - 1) for f, n in zip(self.filled, state.lengths)]
