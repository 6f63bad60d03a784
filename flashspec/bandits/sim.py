"""Synthetic bandit problems and a simulator vectorised over seeds (replicates).

A scenario fixes per-round true means ``[T, K]`` (stationary, piecewise-stationary with change
points, or switched by a per-round domain). Rewards are Bernoulli(μ) or Beta with mean μ and
concentration c (fractional, like per-step acceptance rates). Regret is the pseudo-regret
Σ_t (μ*_t − μ_{a_t, t}) against the known means (DESIGN.md).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
from tqdm.auto import tqdm

from flashspec.bandits.base import Policy, StepOutcome
from flashspec.bandits.rewards import reward
from flashspec.bandits.shared import expected_accepted
from flashspec.core import Arm
from flashspec.errors import FlashSpecError

REWARD_DISTS = ("bernoulli", "beta")


@dataclass
class Scenario:
    """One synthetic problem: per-round means, reward law, optional per-round domain labels."""

    name: str
    means: np.ndarray  # [T, K]
    rewards: str = "bernoulli"
    concentration: float = 10.0
    domains: list[str] | None = None  # per-round context["domain"], or None
    spec: dict[str, Any] = field(default_factory=dict)  # the inputs, for records

    @property
    def horizon(self) -> int:
        return self.means.shape[0]

    @property
    def n_arms(self) -> int:
        return self.means.shape[1]

    @property
    def gaps(self) -> np.ndarray:
        """``[T, K]`` per-round gap of each arm to that round's best arm."""
        return self.means.max(axis=1, keepdims=True) - self.means

    def context(self, t: int) -> dict[str, Any]:
        return {"step": t, "domain": None if self.domains is None else self.domains[t]}


def make_scenario(name: str, horizon: int, means: Sequence | Mapping[str, Sequence],
                  rewards: str = "bernoulli", concentration: float = 10.0,
                  change_points: Sequence[int] = (), domain_probs: Mapping[str, float] | None = None,
                  seed: int = 0) -> Scenario:
    """Build a scenario.

    ``means``: ``[K]`` (stationary); ``[S, K]`` segments split at ``change_points`` (S − 1
    increasing rounds); or ``{domain: [K]}`` with domains drawn i.i.d. per round from
    ``domain_probs`` (uniform when None) using ``seed``.
    """
    if rewards not in REWARD_DISTS:
        raise FlashSpecError(f"scenario {name}: rewards={rewards!r}, choose one of {REWARD_DISTS}")
    domains = None
    if isinstance(means, Mapping):
        names = list(means)
        probs = np.array([float((domain_probs or {}).get(d, 1.0)) for d in names])
        idx = np.random.default_rng(seed).choice(len(names), size=horizon, p=probs / probs.sum())
        table = np.asarray([means[d] for d in names], dtype=float)[idx]
        domains = [names[i] for i in idx]
    else:
        segs = np.atleast_2d(np.asarray(means, dtype=float))
        cps = [int(c) for c in change_points]
        if len(cps) != len(segs) - 1 or cps != sorted(cps) or (cps and not 0 < cps[0] <= cps[-1] < horizon):
            raise FlashSpecError(f"scenario {name}: {len(segs)} mean segments need {len(segs) - 1} "
                                 f"increasing change points inside (0, {horizon}), got {cps}")
        table = segs[np.searchsorted(cps, np.arange(horizon), side="right")]
    if table.min() < 0 or table.max() > 1:
        raise FlashSpecError(f"scenario {name}: arm means must lie in [0, 1]")
    spec = {"means": _plain(means), "rewards": rewards, "change_points": list(change_points),
            "domain_probs": dict(domain_probs or {}) or None, "horizon": horizon}
    if rewards == "beta":
        spec["concentration"] = concentration
    return Scenario(name, table, rewards, float(concentration), domains, spec)


def env_seeds(base_seed: int, scenario: str, n: int, stream: int) -> list[int]:
    """Per-replicate seeds; ``stream`` separates environment (0) and policy (1) randomness."""
    tag = zlib.crc32(scenario.encode())
    return [int(np.random.SeedSequence([base_seed, tag, r, stream]).generate_state(1)[0])
            for r in range(n)]


def draw_rewards(scn: Scenario, seeds: Sequence[int]) -> np.ndarray:
    """``[n_seeds, T, K]`` rewards of every arm at every round (common to all policies)."""
    out = np.empty((len(seeds), scn.horizon, scn.n_arms), dtype=np.float32)
    for i, s in enumerate(seeds):
        rng = np.random.default_rng(s)
        if scn.rewards == "bernoulli":
            out[i] = rng.random(scn.means.shape) < scn.means
        else:
            mu = np.clip(scn.means, 1e-6, 1 - 1e-6)
            out[i] = rng.beta(mu * scn.concentration, (1 - mu) * scn.concentration)
    return out


@dataclass
class SimResult:
    arms: np.ndarray  # [n_seeds, T] played arms
    regret: np.ndarray  # [n_seeds, T] cumulative pseudo-regret after each round


def simulate(policy: Policy, scn: Scenario, rewards: np.ndarray, full_info: bool = False,
             progress: bool = False, desc: str | None = None) -> SimResult:
    """Run ``policy`` (one replicate per row of ``rewards``) for the scenario's horizon."""
    n, horizon, k = rewards.shape
    if policy.n_envs != n or policy.n_arms != k or horizon != scn.horizon:
        raise FlashSpecError(f"simulate: policy has {policy.n_envs} replicates x {policy.n_arms} arms, "
                             f"rewards are {rewards.shape}, scenario horizon {scn.horizon}")
    rows = np.arange(n)
    arms = np.empty((n, horizon), dtype=np.int64)
    for t in tqdm(range(horizon), disable=not progress, desc=desc, leave=False, mininterval=1.0):
        ctx = scn.context(t)
        a = policy.select_many(ctx)
        arms[:, t] = a
        if full_info:
            policy.update_all_many(rewards[:, t, :].astype(float), None, ctx)
        else:
            policy.update_many(a, rewards[rows, t, a].astype(float), None, ctx)
    inst = scn.gaps[np.arange(horizon)[None, :], arms]
    return SimResult(arms, np.cumsum(inst, axis=1))


@dataclass
class ChainScenario:
    """Arms (drafter, γ) whose steps are drafted chains: each round every drafter's chain
    survives depth d with probability ``alphas[drafter][d - 1]`` given it reached d (one draw per
    drafter and round, shared by its arms: a chain of γ accepts min(run, γ) drafts). An arm's
    reward is the engine's (:func:`flashspec.bandits.rewards.reward`) for a one-row step of
    cost ``costs[k]`` seconds; regret is against the known expected rewards (``arm_means``:
    α = E[n | γ] / γ, tps = (1 + E[n | γ]) / cost). ``means`` / ``gaps`` / ``domains`` /
    ``spec`` read like :class:`Scenario`'s, so the bandit_sim records treat both alike."""

    name: str
    arms: list[Arm]
    alphas: dict[str, np.ndarray]
    costs: np.ndarray        # [K] step seconds of each arm
    reward: str
    horizon: int
    spec: dict[str, Any] = field(default_factory=dict)
    domains: list[str] | None = None
    rewards: str = "chains"

    @property
    def n_arms(self) -> int:
        return len(self.arms)

    @property
    def drafters(self) -> list[str]:
        return list(self.alphas)

    @property
    def arm_means(self) -> np.ndarray:
        """``[K]`` expected reward of each arm."""
        exp_n = np.array([expected_accepted(self.alphas[a.drafter])[a.gamma] for a in self.arms])
        depth = np.array([a.gamma for a in self.arms], dtype=float)
        return exp_n / depth if self.reward == "alpha" else (1.0 + exp_n) / self.costs

    @property
    def reward_range(self) -> float:
        """The largest reward a step can earn (a policy's ``reward_scale``)."""
        if self.reward == "alpha":
            return 1.0
        return float(max((1.0 + a.gamma) / c for a, c in zip(self.arms, self.costs)))

    @property
    def means(self) -> np.ndarray:
        """``[T, K]`` (stationary: every round's row is :attr:`arm_means`)."""
        return np.broadcast_to(self.arm_means, (self.horizon, self.n_arms))

    @property
    def gaps(self) -> np.ndarray:
        return self.means.max(axis=1, keepdims=True) - self.means

    def context(self, t: int) -> dict[str, Any]:
        return {"step": t, "domain": None}


def make_chain_scenario(name: str, horizon: int, alphas: Mapping[str, Sequence[float]],
                        arms: Sequence[Arm | str | Sequence[Any]], costs: Sequence[float] | None = None,
                        reward_kind: str = "tps") -> ChainScenario:
    """``arms``: chain arms (:class:`~flashspec.core.Arm`, their labels ``drafter@γ`` or
    ``[drafter, γ]`` pairs) over the drafters of
    ``alphas`` (per-depth rates, at least γ of them); ``costs``: step seconds per arm
    (default 1: only acceptance matters); ``reward_kind``: ``tps`` or ``alpha``."""
    table = {d: np.asarray(a, dtype=float) for d, a in alphas.items()}
    specs = [Arm.parse(a) for a in arms]
    for a in specs:
        if a.tree is not None or a.drafter not in table or a.gamma > len(table[a.drafter]):
            raise FlashSpecError(f"chain scenario {name}: arm {a} needs a chain of a drafter "
                                 f"of {list(table)} with >= {a.gamma} per-depth rates")
    if any(v.min() < 0 or v.max() > 1 for v in table.values()):
        raise FlashSpecError(f"chain scenario {name}: per-depth rates must lie in [0, 1]")
    if reward_kind not in ("alpha", "tps"):
        raise FlashSpecError(f"chain scenario {name}: reward {reward_kind!r}; choose alpha or tps")
    cost = np.ones(len(specs)) if costs is None else np.asarray(costs, dtype=float)
    if cost.shape != (len(specs),) or not (cost > 0).all():
        raise FlashSpecError(f"chain scenario {name}: need {len(specs)} positive arm costs")
    spec = {"alphas": _plain(alphas), "arms": [a.label for a in specs],
            "costs": cost.tolist(), "reward": reward_kind, "change_points": [],
            "horizon": int(horizon), "means": _plain(None)}
    scn = ChainScenario(name, specs, table, cost, reward_kind, int(horizon), spec)
    scn.spec["means"] = _plain(scn.arm_means)
    return scn


def draw_chains(scn: ChainScenario, seeds: Sequence[int]) -> np.ndarray:
    """``[n_seeds, T, n_drafters]`` accepted-run length of each drafter's chain every round."""
    out = np.empty((len(seeds), scn.horizon, len(scn.drafters)), dtype=np.int64)
    for i, s in enumerate(seeds):
        rng = np.random.default_rng(s)
        for j, d in enumerate(scn.drafters):
            ok = rng.random((scn.horizon, len(scn.alphas[d]))) < scn.alphas[d]
            out[i, :, j] = np.cumprod(ok, axis=1).sum(axis=1)   # leading accepts
    return out


def simulate_chains(policy: Policy, scn: ChainScenario, runs: np.ndarray) -> SimResult:
    """Run ``policy`` on a chain scenario; every update carries the step's
    :class:`~flashspec.bandits.base.StepOutcome` (read by policies that ask for it)."""
    n = runs.shape[0]
    if policy.n_envs != n or policy.n_arms != scn.n_arms:
        raise FlashSpecError(f"simulate_chains: policy has {policy.n_envs} replicates x "
                             f"{policy.n_arms} arms, runs are {runs.shape}, {scn.n_arms} arms")
    policy.bind_arms(scn.arms)
    col = np.array([scn.drafters.index(a.drafter) for a in scn.arms])
    depth = np.array([a.gamma for a in scn.arms])
    arms = np.empty((n, scn.horizon), dtype=np.int64)
    for t in range(scn.horizon):
        ctx = scn.context(t)
        a = policy.select_many(ctx)
        arms[:, t] = a
        acc = np.minimum(runs[np.arange(n), t, col[a]], depth[a])
        r = np.array([reward(scn.reward, int(g), int(k), wall_s=float(c))
                      for g, k, c in zip(depth[a], acc, scn.costs[a])])
        outcome = StepOutcome(depth[a][:, None], acc[:, None])
        policy.update_many(a, r, scn.costs[a], {**ctx, "outcome": outcome})
    gaps = scn.arm_means.max() - scn.arm_means
    return SimResult(arms, np.cumsum(gaps[arms], axis=1))


def _plain(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_plain(v) for v in x]
    return float(x) if isinstance(x, (int, float, np.floating)) else x
