"""Vectorised multi-step speculative sampling over context-free tables.

N independent rows each generate ``length`` tokens. Every step, each active row's chooser picks
a drafter (arm); the drafter proposes γ tokens at the row's next absolute positions; verify is
called once per (arm, chunk of rows); each row advances by its own n_accepted + 1 (ragged).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch
from tqdm.auto import tqdm

from flashspec.core import SamplingParams
from flashspec.verify import rng
from flashspec.verify.sampling import warp_logprobs

VerifyFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
DraftLogits = Callable[[slice], torch.Tensor]   # rows slice -> raw draft logits [rows, γ, V]
CHUNK_ELEMS = 1 << 22          # logits elements per verify call (bounds memory at any V)


@dataclass
class TableDrafter:
    """Drafter reading a context-free table of draft logits [P, V].

    Full q: draft tokens are sampled from warp_logprobs(table, params), and the raw logits are
    handed to verify, which warps them the same way. One-hot (``one_hot=True``): a
    deterministic proposer emitting argmax q at each position, with draft_logits=None.
    """

    logits: torch.Tensor
    gamma: int
    one_hot: bool = False

    def propose(self, pos: torch.Tensor, params: SamplingParams, gen: torch.Generator
                ) -> tuple[torch.Tensor, DraftLogits | None]:
        """Draft tokens [b, γ] at absolute positions ``pos`` [b, γ], and a function giving
        their raw draft logits [rows, γ, V] for a slice of rows (None: one-hot proposal)."""
        logq = warp_logprobs(self.logits, params)                      # [P, V]
        if self.one_hot:
            return logq.argmax(-1)[pos], None
        return sample_positions(logq.exp(), pos, gen), lambda sl: self.logits[pos[sl]]


def sample_positions(probs: torch.Tensor, pos: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One sample from ``probs[pos[i]]`` for every entry of ``pos``, grouped by position."""
    flat = pos.reshape(-1)
    out = torch.empty_like(flat)
    for p in flat.unique().tolist():
        idx = (flat == p).nonzero().squeeze(1)
        out[idx] = torch.multinomial(probs[p], len(idx), replacement=True, generator=gen)
    return out.view_as(pos)


class Chooser(Protocol):
    """Per-row drafter selection that may read only past steps' acceptance."""

    def select(self, rows: torch.Tensor) -> torch.Tensor: ...

    def update(self, rows: torch.Tensor, arm: int, n_accepted: torch.Tensor, gamma: int) -> None: ...


class FixedChooser:
    """Always arm 0."""

    def select(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(rows)

    def update(self, rows: torch.Tensor, arm: int, n_accepted: torch.Tensor, gamma: int) -> None:
        return None


@dataclass
class SpecRun:
    """Tokens [N, length] of a speculative run, plus its acceptance statistics."""

    tokens: np.ndarray
    calls: int = 0
    proposed: int = 0
    accepted: int = 0
    arm_steps: dict[int, int] = field(default_factory=dict)

    @property
    def alpha(self) -> float:
        return self.accepted / max(1, self.proposed)


def speculative_sample(target: torch.Tensor, drafters: list, params: SamplingParams,
                       n_rows: int, length: int, verify_fn: VerifyFn, seed: int,
                       chooser: Chooser | None = None, progress: bool = False) -> SpecRun:
    """Run ragged multi-step speculative sampling until every row has ``length`` tokens."""
    if target.shape[0] < length + max(d.gamma for d in drafters):
        raise ValueError("tables must cover positions up to length + γ - 1")
    chooser = chooser or FixedChooser()
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.zeros(n_rows, dtype=torch.long)
    run = SpecRun(tokens=np.full((n_rows, length), -1, dtype=np.int64))
    bar = tqdm(total=n_rows * length, disable=not progress, desc="spec", leave=False)
    while (active := (lengths < length).nonzero().squeeze(1)).numel():
        arms = chooser.select(active)
        for arm in arms.unique().tolist():
            rows = active[arms == arm]
            _step_arm(run, target, drafters[arm], arm, rows, lengths, params, verify_fn,
                      seed, gen, chooser)
        bar.update(int(lengths.clamp(max=length).sum()) - bar.n)
    bar.close()
    return run


def _step_arm(run: SpecRun, target: torch.Tensor, drafter, arm: int, rows: torch.Tensor,
              lengths: torch.Tensor, params: SamplingParams, verify_fn: VerifyFn, seed: int,
              gen: torch.Generator, chooser: Chooser) -> None:
    """One speculative step for ``rows`` with one drafter; verify runs in memory-bounded chunks."""
    gamma = drafter.gamma
    pos = lengths[rows].unsqueeze(1) + torch.arange(gamma + 1)
    tokens, logits = drafter.propose(pos[:, :gamma], params, gen)
    chunk = max(1, CHUNK_ELEMS // ((gamma + 1) * target.shape[-1]))
    outs, accs = [], []
    for sl in (slice(i, i + chunk) for i in range(0, len(rows), chunk)):
        out, n_acc = verify_fn(target[pos[sl]], tokens[sl], None if logits is None else logits(sl),
                               params, rng.call_seed(seed, run.calls))
        run.calls += 1
        outs.append(out)
        accs.append(n_acc.long())
    out, n_acc = torch.cat(outs), torch.cat(accs)
    _record(run, rows, pos, out, n_acc)
    lengths[rows] += n_acc + 1
    run.proposed += gamma * len(rows)
    run.accepted += int(n_acc.sum())
    run.arm_steps[arm] = run.arm_steps.get(arm, 0) + len(rows)
    chooser.update(rows, arm, n_acc, gamma)


def _record(run: SpecRun, rows: torch.Tensor, pos: torch.Tensor, out: torch.Tensor,
            n_acc: torch.Tensor) -> None:
    """Store emitted tokens (slots j ≤ n_accepted) that fall before ``length``."""
    j = torch.arange(pos.shape[1]).unsqueeze(0)
    keep = (j <= n_acc.long().unsqueeze(1)) & (pos < run.tokens.shape[1])
    r = rows.unsqueeze(1).expand_as(pos)[keep].numpy()
    run.tokens[r, pos[keep].numpy()] = out.long()[keep].numpy()
