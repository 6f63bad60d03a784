"""Goodput planning of the verify width: how many drafted tokens a step should verify.

Each step the policy's arm offers up to γ drafts per row; the planner picks k in 0..γ (0: a
plain target step) that maximises expected committed tokens per second,

    value(k) = Σ_i w_i · E_i[tokens | k] / cost(k),   E_i = 1 + Σ_{j=1..min(k, m_i)} a_i^j,

from the past only (so every choice keeps decoding exact): a_i is row i's acceptance rate
(decayed counts, shrunk toward the batch's rate), m_i how many drafts row i really has (an
n-gram row without a match has none), and cost(k) the measured wall time of steps of width
k + 1 (an exponential average; unmeasured widths are interpolated; the widths 0, γ/2 and γ are
each tried ``explore`` times first). Under static batching a batch ends with its slowest row, so
the default weights (``objective='makespan'``) count only the rows within γ + 1 tokens of the
largest remaining budget: speculation is bought where it shortens the batch, and a batch where
it does not pay decodes as plain AR. ``objective='total'`` counts every live row.

A draft-tree arm (:mod:`flashspec.tree`) of depth D may also draft a chain: ``plan_tree``
plans a chain of k <= D drafts of the tree's drafter as above (k = 0: a plain target step), and
plays the whole tree instead when its measured tokens per step (decayed mean of accepted + 1
over live rows) over its measured step cost (the tree's own width and drafting, kept per arm)
beats that chain's value; after ``reprobe`` decisions against the tree in a row it plays the
tree once more, so one hard prompt cannot shut the tree out for the rest of the run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from flashspec.core import Arm
from flashspec.errors import FlashSpecError

OBJECTIVES = ("makespan", "total")


def _call(available: list[int] | Callable[[], list[int]]) -> list[int]:
    return available() if callable(available) else available


@dataclass
class WidthPlanner:
    """Chooses the verify width of each step from measured step costs and acceptance rates."""

    objective: str = "makespan"
    explore: int = 2          # measurements of each probe width before exploiting
    decay: float = 0.9        # per-observation memory of the acceptance counts
    smoothing: float = 0.3    # weight of a new step time in the cost average
    prior: float = 2.0        # pseudo-trials pulling a row's rate toward the batch rate
    replan: int = 4           # steps a decision is kept (planning costs Python time per row)
    reprobe: int = 16         # decisions against a tree after which it is tried again
    cost: dict[int, float] = field(default_factory=dict)
    seen: dict[int, int] = field(default_factory=dict)
    tree_cost: dict[Arm, float] = field(default_factory=dict)    # per tree arm
    tree_seen: dict[Arm, int] = field(default_factory=dict)
    tree_gain: dict[Arm, tuple[float, float]] = field(default_factory=dict)  # (accepted, row-steps)
    tree_idle: dict[Arm, int] = field(default_factory=dict)  # plain-step decisions in a row

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise FlashSpecError(f"planner objective {self.objective!r}; choose one of {OBJECTIVES}")
        self.reset(0)

    def reset(self, batch: int) -> None:
        """New batch: acceptance memory per row starts over; step costs are kept."""
        self.succ, self.trials = [0.0] * batch, [0.0] * batch
        self.batch_succ, self.batch_trials = 0.0, 0.0
        self.kept, self.last = 0, (0, 0)     # steps the last decision (γ, k) still holds

    # ------------------------------------------------------------------ estimates
    def alpha(self, row: int) -> float:
        batch = (self.batch_succ + 1.0) / (self.batch_trials + 2.0)
        return (self.succ[row] + self.prior * batch) / (self.trials[row] + self.prior)

    def step_cost(self, k: int) -> float:
        """Measured (or interpolated) wall time of a step verifying k drafts."""
        if k in self.cost:
            return self.cost[k]
        below = [j for j in self.cost if j < k]
        above = [j for j in self.cost if j > k]
        if not below or not above:
            return self.cost[max(below) if below else min(above)]
        lo, hi = max(below), min(above)
        return self.cost[lo] + (self.cost[hi] - self.cost[lo]) * (k - lo) / (hi - lo)

    # ------------------------------------------------------------------ decisions
    def plan(self, gamma: int, available: list[int] | Callable[[], list[int]],
             remaining: list[int]) -> int:
        """k in 0..gamma for this step; ``available[i]``: drafts row i has (or a function that
        finds them: it is not called when even γ drafts on every row would not pay),
        ``remaining[i]``: its token budget left (0: finished)."""
        if gamma <= 0:
            return 0
        fresh = self._unexplored(gamma)
        if not fresh and self.kept > 0 and self.last[0] == gamma:
            self.kept -= 1
            return min(self.last[1], max(_call(available), default=0)) if self.last[1] else 0
        k = self._decide(gamma, available, remaining, fresh)
        if not fresh:
            self.kept, self.last = self.replan - 1, (gamma, k)
        return k

    def _unexplored(self, gamma: int) -> list[int]:
        """The probe widths 0, γ/2 and γ not yet measured ``explore`` times, smallest first."""
        probes = sorted({0, max(1, gamma // 2), gamma}) if gamma > 0 else [0]
        return [k for k in probes if self.seen.get(k, 0) < self.explore]

    def _decide(self, gamma: int, available: list[int] | Callable[[], list[int]],
                remaining: list[int], fresh: list[int]) -> int:
        if callable(available):
            if not fresh and self._best(gamma, [gamma] * len(remaining), remaining) == 0:
                return 0      # an upper bound: drafting is not worth looking up
            available = available()
        if max(available, default=0) == 0:
            return 0
        return fresh[0] if fresh else self._best(gamma, available, remaining)

    def _best(self, gamma: int, available: list[int], remaining: list[int]) -> int:
        values = self._values(gamma, available, remaining)
        return values.index(max(values))    # ties keep the smaller k

    def _values(self, gamma: int, available: list[int], remaining: list[int]) -> list[float]:
        """value(k) for k = 0..γ: Σ_rows E_i[tokens | k] / cost(k) over the rows counted."""
        live = [i for i, r in enumerate(remaining) if r > 0]
        if self.objective == "makespan":
            top = max(remaining[i] for i in live)
            live = [i for i in live if remaining[i] >= top - gamma - 1]
        rows = [(self.alpha(i), available[i]) for i in live if available[i] > 0]
        # built up k by k: row i adds a_i^k while it has k drafts (rows without drafts commit
        # one token at any k)
        tokens, power = float(len(live)), [1.0] * len(rows)
        values = [tokens / self.step_cost(0)]
        for k in range(1, gamma + 1):
            for r, (a, m) in enumerate(rows):
                if m >= k:
                    power[r] *= a
                    tokens += power[r]
            values.append(tokens / self.step_cost(k))
        return values

    def _measured(self, cost: dict, seen: dict, key, step_s: float) -> None:
        """A step time into ``cost[key]`` (exponential average) and its count into ``seen``."""
        old = cost.get(key)
        cost[key] = step_s if old is None else old + self.smoothing * (step_s - old)
        seen[key] = seen.get(key, 0) + 1

    def plan_tree(self, arm: Arm, remaining: list[int]) -> int | None:
        """None: verify the tree of ``arm`` this step; else k in 0..γ (the tree's depth), a
        chain of k drafts of the tree's drafter (0: a plain target step). The chain's probe
        widths are measured first, then the tree; then the tree plays while its tokens per
        second beat the chain's best value."""
        gamma = arm.gamma
        drafts = [gamma if r > 0 else 0 for r in remaining]   # a model drafter always has γ
        k = self.plan(gamma, drafts, remaining)
        if self._unexplored(gamma):
            return k
        if self.tree_seen.get(arm, 0) < self.explore:
            return None
        acc, steps = self.tree_gain.get(arm, (0.0, 0.0))
        n_live = sum(1 for r in remaining if r > 0)
        tree_value = n_live * (1.0 + acc / max(steps, 1e-9)) / self.tree_cost[arm]
        idle = self.tree_idle.get(arm, 0)
        play = tree_value > self._values(gamma, drafts, remaining)[k] or idle >= self.reprobe
        self.tree_idle[arm] = 0 if play else idle + 1
        return None if play else k

    def observe_tree_counts(self, arm: Arm, step_s: float, accepted: int, row_steps: int
                            ) -> None:
        """Tree steps at once (the resident loop's chunks): the mean step time, the accepted
        drafts and the live row-steps summed over them."""
        self._measured(self.tree_cost, self.tree_seen, arm, step_s)
        acc, steps = self.tree_gain.get(arm, (0.0, 0.0))
        self.tree_gain[arm] = (self.decay * acc + accepted, self.decay * steps + row_steps)

    def observe_counts(self, k: int, step_s: float | None, hits: list[int], tries: list[int]
                       ) -> None:
        """Several steps of width k at once (the resident loop's chunks): the mean step time
        and, per row, accepted drafts and acceptance trials summed over those steps."""
        if step_s is not None:
            self._measured(self.cost, self.seen, k, step_s)
        step_succ = step_trials = 0
        for i, (hit, tried) in enumerate(zip(hits, tries)):
            if not tried:
                continue
            self.succ[i] = self.decay * self.succ[i] + hit
            self.trials[i] = self.decay * self.trials[i] + tried
            step_succ, step_trials = step_succ + hit, step_trials + tried
        if step_trials:
            self.batch_succ = self.decay * self.batch_succ + step_succ
            self.batch_trials = self.decay * self.batch_trials + step_trials
