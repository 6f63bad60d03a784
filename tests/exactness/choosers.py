"""Drafter choosers for the bandit gate: one independent bandit per row, reading only past
steps' acceptance (``PolicyChooser``), and a planted cheat that peeks at the current draft and
target (``PeekingDrafter``), which exactness forbids."""
from __future__ import annotations

import numpy as np
import torch

from flashspec.bandits import UCB1, Policy, ThompsonSampling
from flashspec.core import SamplingParams
from flashspec.verify.sampling import warp_logprobs


# The bandit policies the gate runs, by name (each built with its class defaults).
POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (UCB1, ThompsonSampling)}


class PolicyChooser:
    """Policy ``name`` (``POLICIES[name](K, seed=[...])``) with one replicate per row; reward
    α = accepted/γ, or with ``reward="tps"`` tokens per unit of a step cost that grows with γ
    ((accepted + 1) / (1 + γ/4), the cost fed back beside it: the rate policies' input).

    Rewards of a step are collected per arm group and fed back (``update_many``) before the
    next selection; rows that finished get NaN (unobserved).
    """

    def __init__(self, name: str, n_arms: int, n_rows: int, seed: int = 0,
                 reward: str = "alpha") -> None:
        self.policy = POLICIES[name](n_arms, seed=list(range(seed, seed + n_rows)), reward=reward)
        self.pending_arms = np.zeros(n_rows, dtype=np.int64)
        self.pending = np.full(n_rows, np.nan)
        self.costs = np.ones(n_rows)
        self.history: list[np.ndarray] = []

    def select(self, rows: torch.Tensor) -> torch.Tensor:
        if not np.isnan(self.pending).all():
            self.policy.update_many(self.pending_arms, self.pending, self.costs)
        self.pending[:] = np.nan
        arms = self.policy.select_many()
        self.history.append(arms[rows.numpy()])
        return torch.from_numpy(arms)[rows]

    def update(self, rows: torch.Tensor, arm: int, n_accepted: torch.Tensor, gamma: int) -> None:
        r = rows.numpy()
        self.pending_arms[r] = arm
        if self.policy.reward_kind == "tps":
            self.costs[r] = 1.0 + gamma / 4
            self.pending[r] = (n_accepted.numpy() + 1) / self.costs[r]
        else:
            self.pending[r] = n_accepted.numpy() / gamma


class PeekingDrafter:
    """PLANTED BUG: per row, proposes from whichever inner drafter's first draft token has the
    highest current target probability (it reads this step's drafts and target), then hands
    verify that drafter's q, as if the choice had been made blind."""

    def __init__(self, inner: list, target: torch.Tensor) -> None:
        if len({d.gamma for d in inner}) != 1:
            raise ValueError("inner drafters must share γ")
        self.inner, self.target, self.gamma = inner, target, inner[0].gamma

    def propose(self, pos: torch.Tensor, params: SamplingParams, gen: torch.Generator):
        logp = warp_logprobs(self.target, params)
        props = [d.propose(pos, params, gen) for d in self.inner]
        score = torch.stack([logp[pos[:, 0], tok[:, 0]] for tok, _ in props], dim=1)
        best = score.argmax(dim=1)
        tokens = torch.stack([tok for tok, _ in props])[best, torch.arange(len(best))]
        tables = torch.stack([d.logits for d in self.inner])                  # [K, P, V]
        return tokens, lambda sl: tables[best[sl].unsqueeze(1), pos[sl]]


class SwitchOnRejectChooser:
    """Legal but strongly history-dependent: a row moves to the next arm after any step in
    which a draft was rejected, and stays after a fully accepted step."""

    def __init__(self, n_arms: int, n_rows: int) -> None:
        self.n_arms = n_arms
        self.arm = torch.zeros(n_rows, dtype=torch.long)
        self.history: list[torch.Tensor] = []

    def select(self, rows: torch.Tensor) -> torch.Tensor:
        self.history.append(self.arm[rows].clone())
        return self.arm[rows]

    def update(self, rows: torch.Tensor, arm: int, n_accepted: torch.Tensor, gamma: int) -> None:
        self.arm[rows] = torch.where(n_accepted < gamma, (arm + 1) % self.n_arms, arm)
