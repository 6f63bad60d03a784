"""Policy base class: a batched core (one independent bandit per seed) behind a scalar API.

The engine drives one policy with the scalar calls ``select`` / ``update`` / ``update_all``.
Simulations drive many independent replicates at once with ``select_many`` /
``update_many`` / ``update_all_many``: state is held as ``[n_envs, n_arms]`` arrays and
each replicate owns its own seeded generator, so replicate ``r`` of a batched policy makes
exactly the choices a scalar policy built with ``seed=seeds[r]`` would make.

A policy reads only what it was told in past updates: it never sees the current draft or
target distribution, which is what keeps speculative decoding exact whatever it chooses.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from flashspec.bandits.rewards import REWARD_KINDS
from flashspec.core import Arm
from flashspec.errors import FlashSpecError

Context = dict[str, Any] | None


@dataclass(frozen=True)
class StepOutcome:
    """What a finished step revealed, given to ``update`` under ``context["outcome"]`` to a
    policy that lists ``"outcome"`` in :attr:`Policy.outcome_keys`: per replicate and batch row,
    the drafts the step verified (``tried``; 0 for a row that was not live or had no drafts)
    and how many of them the target accepted. ``chain``: a tree arm was played as a chain of
    its drafter (the width planner's choice). It describes the past step only, never the draft
    the next ``select`` will be made for.
    """

    tried: np.ndarray      # [n_envs, rows] ints
    accepted: np.ndarray   # [n_envs, rows] ints, 0 <= accepted <= tried
    chain: bool = False


class UniformStream:
    """Per-replicate uniforms drawn from each replicate's generator in blocks.

    ``take(n)`` returns ``[n_envs, n]`` values in [0, 1); every replicate consumes its own
    generator in the same order whatever the batch size, so batching changes nothing.
    """

    def __init__(self, rngs: list[np.random.Generator], block: int = 512) -> None:
        self.rngs = rngs
        self.block = block
        self.buf = np.empty((len(rngs), 0))
        self.pos = 0

    def take(self, n: int) -> np.ndarray:
        if self.pos + n > self.buf.shape[1]:
            rest = self.buf[:, self.pos:]
            size = max(self.block, n)
            fresh = np.stack([g.random(size) for g in self.rngs])
            self.buf = np.concatenate([rest, fresh], axis=1)
            self.pos = 0
        out = self.buf[:, self.pos:self.pos + n]
        self.pos += n
        return out


class Policy:
    """K-armed bandit policy over ``n_envs`` independent replicates (one per seed).

    Args:
        n_arms: number of arms K (the engine maps an arm index to a :class:`~flashspec.core.Arm`).
        seed: an int (one replicate, the engine's case) or a sequence of ints (one
            replicate per seed, for vectorised simulation).
        reward: what the engine feeds back after each step (:data:`REWARD_KINDS`): ``alpha``
            (acceptance rate), ``tps`` (tokens per second of the step) or ``accepted_per_cost``.
        reward_scale: rewards are divided by this before policies that need [0, 1]
            (UCB bonuses, Beta posteriors, EXP3) use them; set it to the reward's range
            when the reward is not a rate in [0, 1] (e.g. ``reward: tps``).
        full_info: the caller may feed every arm's outcome (``update_all``) when it knows it.

    Class attributes declare the rest of what the engine reads: ``learns`` (False for a
    policy whose choice never depends on feedback) and :attr:`context_keys` (context entries
    the policy conditions on; the engine computes drafter features only when asked) and
    :attr:`outcome_keys` (what ``update`` reads of the finished step besides its reward), and
    ``takes_priors`` (whether :meth:`warm_start` can seed it from an earlier run's stats).
    """

    name = "policy"
    learns = True
    takes_priors = False   # warm_start supported: a policy whose state is counts and sums
    # never seeded from stored priors, whatever the run's priors.use: a cold twin of a warm
    # policy in the same run (label suffix "/cold"); set by the runner from the bandit's config
    cold = False

    def __init__(self, n_arms: int, seed: int | Sequence[int] = 0, reward: str = "alpha",
                 reward_scale: float = 1.0, full_info: bool = False) -> None:
        if int(n_arms) < 1:
            raise FlashSpecError(f"bandit needs at least one arm, got n_arms={n_arms}")
        if not reward_scale > 0:
            raise FlashSpecError(f"bandit reward_scale must be > 0, got {reward_scale}")
        if reward not in REWARD_KINDS:
            raise FlashSpecError(f"bandit.reward={reward!r} is unknown; choose one of "
                                 f"{', '.join(REWARD_KINDS)}")
        self.reward_kind = reward
        self.full_info = bool(full_info)
        self.n_arms = int(n_arms)
        self.seeds = [int(seed)] if np.isscalar(seed) else [int(s) for s in seed]
        if not self.seeds:
            raise FlashSpecError("bandit needs at least one seed")
        self.n_envs = len(self.seeds)
        self.reward_scale = float(reward_scale)
        self.rngs = [np.random.default_rng(s) for s in self.seeds]
        self.uniforms = UniformStream(self.rngs)
        self.t = 0  # update rounds seen so far
        shape = (self.n_envs, self.n_arms)
        self._counts = np.zeros(shape)
        self._sums = np.zeros(shape)
        self._cost_sums = np.zeros(shape)
        self._prior_pulls = 0.0   # pseudo-pulls warm_start added (UCB1 counts them in its t)
        self.arm_specs: list[Arm] | None = None   # what each arm is, once bound
        # a policy that estimates each arm's reward rate (flashspec.bandits.rate.RateStats) sets
        # it; feedback, priors and the estimates then go through it here
        self.rates = None

    @property
    def context_keys(self) -> tuple[str, ...]:
        """Context entries this policy reads besides ``step`` and ``domain`` (none here)."""
        return ()

    @property
    def outcome_keys(self) -> tuple[str, ...]:
        """Update-context entries describing the finished step (``"outcome"``: a
        :class:`StepOutcome`) this policy reads; the engine builds them only when asked."""
        return ()

    def bind_arms(self, arms: Sequence[Arm]) -> None:
        """Told once, before any step, what each arm is (the engine calls it). A policy that
        treats arms as unrelated (every one here but :mod:`flashspec.bandits.shared`) only
        checks the count."""
        if len(arms) != self.n_arms:
            raise FlashSpecError(f"bandit: told {len(arms)} arms, built for {self.n_arms}")
        self.arm_specs = list(arms)

    def warm_start(self, pulls: Sequence[float], means: Sequence[float],
                   costs: Sequence[float] | None = None, weight: float = 20.0) -> None:
        """Starts every replicate as if arm k had been played ``min(pulls[k], weight)`` times
        with mean reward ``means[k]`` (raw, in this policy's reward kind) and mean cost
        ``costs[k]`` (NaN or None: unknown, counted as 1.0 like an update without cost).

        What an earlier run measured (:mod:`flashspec.bandits.priors`) then decides the first
        picks instead of a round of exploration; the cap keeps the prior worth ``weight`` steps
        at most, so a policy whose arms now behave otherwise moves off it. Arrays are in this
        policy's arm order: align them by label first (:meth:`Priors.aligned`). Only before
        the first update; a policy whose state is not counts and sums refuses
        (``takes_priors``)."""
        if not self.takes_priors:
            raise FlashSpecError(f"bandit={self.name} does not start from priors; run it cold "
                                 "(priors.use=false)")
        if self.t:
            raise FlashSpecError(f"bandit={self.name}: warm_start after {self.t} updates; it "
                                 "only seeds a fresh policy")
        if not weight >= 0:
            raise FlashSpecError(f"priors weight must be >= 0, got {weight}")
        n = np.minimum(np.asarray(pulls, dtype=float), float(weight))
        mean = np.asarray(means, dtype=float)
        cost = np.ones(self.n_arms) if costs is None else \
            np.nan_to_num(np.asarray(costs, dtype=float), nan=1.0)
        if not n.shape == mean.shape == cost.shape == (self.n_arms,):
            raise FlashSpecError(f"warm_start: pulls, means and costs must be [{self.n_arms}] "
                                 f"(one per arm), got {n.shape}, {mean.shape}, {cost.shape}")
        if (n < 0).any() or not np.isfinite(mean).all() or not (cost > 0).all():
            raise FlashSpecError("warm_start: pulls must be >= 0, means finite, costs > 0")
        self._seed_prior(n, mean, cost)
        self._prior_pulls = float(n.sum())

    def _seed_prior(self, n: np.ndarray, mean: np.ndarray, cost: np.ndarray) -> None:
        """Adds ``n[k]`` pseudo-observations of mean ``mean[k]`` to every replicate's state."""
        if self.rates is not None:
            self.rates.seed(n, mean, cost)
        self._counts += n
        self._sums += n * mean
        self._cost_sums += n * cost

    @property
    def label(self) -> str:
        """Short name for records and tables: ``ucb1``, ``ucb1/tps``, ``contextual[ngram_hit]/tps``."""
        return self.name + self._label_suffix()

    def _label_suffix(self) -> str:
        """What every label ends with: the reward kind unless α, then ``/cold`` for a cold twin."""
        return ("" if self.reward_kind == "alpha" else f"/{self.reward_kind}") + \
            ("/cold" if self.cold else "")

    # ---------------------------------------------------------------- scalar API (engine)
    def select(self, context: Context = None) -> int:
        """Arm to play at this step; reads only past updates."""
        self._need_single("select")
        return int(self.select_many(context)[0])

    def update(self, arm: int, reward: float, cost: float = 1.0, context: Context = None) -> None:
        """Record the reward (and cost) of the arm that was played."""
        self._need_single("update")
        self.update_many(np.array([arm]), np.array([reward], dtype=float),
                         np.array([cost], dtype=float), context)

    def update_all(self, rewards: Sequence[float | None], costs: Sequence[float | None] | None = None,
                   context: Context = None) -> None:
        """Full-information update: the reward every arm would have got (None = unknown).

        A None cost counts as 1.0.
        """
        self._need_single("update_all")
        r = np.array([[np.nan if x is None else float(x) for x in rewards]])
        c = None if costs is None else np.array([[1.0 if x is None else float(x) for x in costs]])
        self.update_all_many(r, c, context)

    # ---------------------------------------------------------------- batched API (simulation)
    def select_many(self, context: Context = None) -> np.ndarray:
        """One arm per replicate, ``[n_envs]`` ints."""
        return self.argmax(self._scores(context))

    def update_many(self, arms: np.ndarray, rewards: np.ndarray, costs: np.ndarray | None = None,
                    context: Context = None) -> None:
        """Bandit feedback: replicate ``b`` played ``arms[b]`` and got ``rewards[b]``."""
        arms = np.asarray(arms, dtype=np.int64).reshape(-1)
        if arms.shape != (self.n_envs,) or arms.min() < 0 or arms.max() >= self.n_arms:
            raise FlashSpecError(f"bandit update: arms {arms.tolist()[:8]} must be {self.n_envs} "
                                 f"indices in [0, {self.n_arms})")
        rows = np.arange(self.n_envs)
        r = np.full((self.n_envs, self.n_arms), np.nan)
        r[rows, arms] = np.asarray(rewards, dtype=float).reshape(-1)
        c = np.full_like(r, np.nan)
        c[rows, arms] = 1.0 if costs is None else np.asarray(costs, dtype=float).reshape(-1)
        self._check(r, c)
        self._observe(r, c, arms, context)

    def update_all_many(self, rewards: np.ndarray, costs: np.ndarray | None = None,
                        context: Context = None) -> None:
        """Full-information feedback ``[n_envs, n_arms]``; NaN marks an unknown reward."""
        r = np.asarray(rewards, dtype=float).reshape(self.n_envs, self.n_arms)
        c = np.where(np.isnan(r), np.nan, 1.0) if costs is None else \
            np.where(np.isnan(r), np.nan, np.asarray(costs, dtype=float).reshape(r.shape))
        self._check(r, c)
        self._observe(r, c, None, context)

    # ---------------------------------------------------------------- logging
    @property
    def counts(self) -> np.ndarray:
        """Observations per arm: ``[K]`` for one replicate, ``[n_envs, K]`` for a batch."""
        return self._squeeze(self._counts)

    @property
    def values(self) -> np.ndarray:
        """The policy's current estimate of each arm's mean reward (0 where unobserved)."""
        return self._squeeze(self._estimates())

    @property
    def mean_costs(self) -> np.ndarray:
        """Mean cost per observation of each arm (0 where unobserved)."""
        return self._squeeze(_safe_div(self._cost_sums, self._counts))

    # ---------------------------------------------------------------- hooks for subclasses
    def _scores(self, context: Context) -> np.ndarray:
        """``[n_envs, K]`` scores; the arm with the highest score is played."""
        raise NotImplementedError

    def _observe(self, r: np.ndarray, c: np.ndarray, pulled: np.ndarray | None, context: Context) -> None:
        """Fold one round of feedback in (NaN = not observed); ``pulled`` is None for full info."""
        if self.rates is not None:
            self.rates.observe(r, c)
        seen = ~np.isnan(r)
        self.t += 1
        self._counts += seen
        self._sums += np.where(seen, r, 0.0)
        self._cost_sums += np.where(seen, c, 0.0)

    def _estimates(self) -> np.ndarray:
        return _safe_div(self._sums, self._counts) if self.rates is None else self.rates.rate()

    # ---------------------------------------------------------------- helpers
    def unit(self, r: np.ndarray) -> np.ndarray:
        """Rewards mapped to [0, 1] by ``reward_scale`` (clipped; NaN kept)."""
        return np.clip(r / self.reward_scale, 0.0, 1.0)

    def argmax(self, scores: np.ndarray) -> np.ndarray:
        """Row-wise argmax; ties broken uniformly by the tied replicate's own generator."""
        best = scores.max(axis=1, keepdims=True)
        tied = scores == best
        arms = tied.argmax(axis=1)
        for b in np.flatnonzero(tied.sum(axis=1) > 1):
            arms[b] = self.rngs[b].choice(np.flatnonzero(tied[b]))
        return arms

    def _check(self, r: np.ndarray, c: np.ndarray) -> None:
        seen = ~np.isnan(r)
        if np.isinf(r).any():
            raise FlashSpecError("bandit update: rewards must be finite (got inf)")
        if (seen & ~(c > 0)).any() or np.isinf(c).any():
            raise FlashSpecError("bandit update: costs must be finite and > 0")

    def _need_single(self, what: str) -> None:
        if self.n_envs != 1:
            raise FlashSpecError(f"{what}() is the one-replicate API; this policy holds "
                                 f"{self.n_envs} replicates, use {what}_many()")

    def _squeeze(self, x: np.ndarray) -> np.ndarray:
        return x[0].copy() if self.n_envs == 1 else x.copy()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n_arms={self.n_arms}, n_envs={self.n_envs}, t={self.t})"


def _safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    return np.divide(num, den, out=np.zeros_like(num, dtype=float), where=den > 0)
