"""The drafter interface and the decode state that drafters read."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
