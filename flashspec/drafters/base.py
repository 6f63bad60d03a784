"""The drafter interface and the decode state that drafters read."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashspec.graphs import GraphCache
from flashspec.verify.sampling import SamplingParams


@dataclass
class DecodeState:
    """Committed tokens of every row, on device and on host.

    ``tokens[b, :lengths[b]]`` is row b's prompt plus accepted output. The target's KV cache
    holds positions ``0 .. lengths[b] - 2``: the last committed token is fed at the next step.
    """

    tokens: torch.Tensor                  # [B, capacity] int64, padded with 0
    lengths: list[int]                    # committed length per row (host)
    host_tokens: list[list[int]]          # same content as ``tokens`` (host)
    finished: list[bool]
    # Target hidden states (after the final norm) of the last target forward, [B, w, d]:
    # column j of row b is the state at position hidden_start[b] + j; the first
    # hidden_valid[b] columns belong to committed tokens (feature-level drafters read them).
    hidden: torch.Tensor | None = None
    hidden_start: list[int] = field(default_factory=list)
    hidden_valid: list[int] = field(default_factory=list)
    domain: str | None = None

    def set_hidden(self, hidden: torch.Tensor, start: list[int], valid: list[int] | None) -> None:
        self.hidden, self.hidden_start = hidden, start
        self.hidden_valid = valid if valid is not None else [0] * len(start)

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def window(self, starts: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and positions [B, width] from ``starts[b]`` on (beyond a row's length: padding)."""
        pos = torch.tensor(starts, device=self.device)[:, None] + torch.arange(width, device=self.device)
        pos = pos.clamp(max=self.tokens.shape[1] - 1)
        return self.tokens.gather(1, pos), pos


class Drafter:
    """Proposes γ tokens per row; ``q`` is the exact distribution they were sampled from.

    ``propose`` returns (tokens [B, γ'], logits [B, γ', V] or None) with γ' <= γ (None: the
    proposal is deterministic, so q is one-hot). ``observe`` is called after every commit so the
    drafter can roll its own state back; ``reset`` before every new batch of prompts.
    """

    name: str = "drafter"
    uses_hidden: bool = False
    one_hot: bool = False       # True: propose() never returns draft logits (deterministic q)

    def reset(self, batch: int, capacity: int) -> None:
        """Prepare for a new batch of ``batch`` rows with room for ``capacity`` positions."""

    def propose(self, state: DecodeState, gamma: int, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def observe(self, state: DecodeState, n_accepted: list[int]) -> None:
        """Rows advanced by n_accepted[b] + 1 tokens (already in ``state``)."""

    def features(self, state: DecodeState) -> dict[str, object]:
        """Cheap facts about the next step a context-conditioned bandit may read (past only)."""
        return {}


class GraphedDrafting:
    """Mixin of model drafters: all γ drafting steps as one device function that a CUDA graph
    can record (:class:`flashspec.graphs.GraphCache`).

    The subclass implements ``_draft(tokens, positions, last_idx, last_pos, gamma, params,
    generator, seed, span)``: a catch-up window [B, w] whose column ``last_idx[b]`` is row b's
    last committed token, then γ drafts at positions ``last_pos[b] + i``. ``span`` None attends
    the whole cache (what a graph needs); ``seed`` (a device scalar) makes sampling counter-based
    (Gumbel-max), else the torch ``generator`` samples. Windows longer than γ + 1 (the first
    step after a prompt) always run eagerly.
    """

    graphs: GraphCache | None = None
    catching_up: bool = False   # the last proposal ran a long eager window (e.g. a new prompt)

    def _draft(self, tokens: torch.Tensor, positions: torch.Tensor, last_idx: torch.Tensor,
               last_pos: torch.Tensor, gamma: int, params: SamplingParams,
               generator: torch.Generator | None, seed: torch.Tensor | None, span: int | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def use_graphs(self, capture: bool) -> None:
        """Draft through static buffers from now on (CUDA graphs when ``capture``)."""
        if self.graphs is None or self.graphs.capture != capture:
            self.graphs = GraphCache(self._replayed, capture)

    def prepare_graphs(self, batch: int, gamma: int, params: SamplingParams,
                       device: torch.device) -> None:
        """Capture every (γ' <= γ, window <= γ' + 1) drafting shape up front (the cold start).
        Dummy windows write drafter cache slots that a prompt rewrites before they are read."""
        if self.graphs is None or not self.graphs.capture:
            return
        for g in range(1, gamma + 1):
            for w in range(1, g + 2):
                if (batch, w, g, params) in self.graphs.slots:
                    continue
                pos = torch.arange(w, device=device).expand(batch, w).contiguous()
                last = torch.full((batch,), w - 1, dtype=torch.long, device=device)
                seed = torch.zeros((), dtype=torch.long, device=device)
                self.graphs((batch, w, g, params), pos, pos, last, last + 1, seed)

    def _replayed(self, key: tuple, tokens: torch.Tensor, positions: torch.Tensor,
                  last_idx: torch.Tensor, last_pos: torch.Tensor, seed: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, gamma, params = key
        return self._draft(tokens, positions, last_idx, last_pos, gamma, params, None,
                           None if params.greedy else seed, None)

    def _drafts(self, state: DecodeState, starts: list[int], width: int, gamma: int,
                params: SamplingParams, generator: torch.Generator | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts and their logits from the window of ``width`` tokens at ``starts``."""
        dev = state.device
        self.catching_up = width > gamma + 1
        tokens, positions = state.window(starts, width)
        last_idx = torch.tensor([n - 1 - s for n, s in zip(state.lengths, starts)], device=dev)
        last_pos = torch.tensor(state.lengths, device=dev)
        if self.graphs is None or width > gamma + 1:
            return self._draft(tokens, positions, last_idx, last_pos, gamma, params, generator,
                               None, max(state.lengths))
        seed = (torch.zeros((), dtype=torch.long, device=dev) if params.greedy else
                torch.randint(0, 1 << 31, (), device=dev, generator=generator))
        return self.graphs((state.batch, width, gamma, params), tokens, positions, last_idx,
                           last_pos, seed)

