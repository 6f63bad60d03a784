"""Thompson sampling on an arm's reward *rate*: Σ r·c / Σ c, reward per unit of cost.

With ``reward: tps`` (r = tokens / step seconds) and cost = the step's seconds, the rate is the
arm's pooled tokens per second, total tokens / total time: what a throughput run measures.
The mean of per-step tok/s (what the other policies estimate) is a different, biased target:
a cheap step with a lucky acceptance counts as much as an expensive one.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from flashspec.bandits.base import Context, Policy
from flashspec.errors import FlashSpecError


class RateThompson(Policy):
    """Gaussian Thompson sampling on the ratio estimate R = X / C (X = Σ r·c, C = Σ c).

    The posterior of R is the ratio estimator's normal approximation (the delta method): mean
    R̂, variance n · σ² / C², where σ² is the arm's residual variance Σ (x_i − R̂ c_i)² / (n − 1)
    shrunk towards the variance pooled over all arms with ``prior_weight`` pseudo-steps. The
    shrinkage keeps an arm whose first steps happened to agree (two zero rewards: σ² = 0)
    from being locked out for good. Each step plays the arm with the largest draw
    R̂ + explore · sd · N(0, 1); an arm seen fewer than ``min_pulls`` times plays first.
    Rewards are not squashed to [0, 1], so ``reward_scale`` does not matter here.

    ``discount`` < 1 makes it a policy for streams whose best arm changes (a prompt stream that
    moves between code, chat and editing): before each update every arm's sums and counts are
    multiplied by it, so evidence fades with a memory of about 1 / (1 − discount) steps, and an
    arm left alone long enough falls back under ``min_pulls`` and is tried again.
    """

    name = "rate_thompson"

    def __init__(self, n_arms: int, seed: int | Sequence[int] = 0, explore: float = 1.0,
                 min_pulls: int = 2, prior_weight: float = 1.0, discount: float = 1.0,
                 **kw: float) -> None:
        super().__init__(n_arms, seed, **kw)
        if not explore >= 0 or int(min_pulls) < 2 or not prior_weight >= 0:
            raise FlashSpecError(f"bandit={self.name}: explore={explore} and "
                                 f"prior_weight={prior_weight} must be >= 0 and "
                                 f"min_pulls={min_pulls} >= 2 (a variance needs two steps)")
        if not 0.0 < discount <= 1.0:
            raise FlashSpecError(f"bandit={self.name}: discount={discount} must lie in (0, 1]")
        self.discount = float(discount)
        if self.discount < 1.0:
            self.name = "d_rate_thompson"
        self.explore, self.min_pulls = float(explore), int(min_pulls)
        self.prior_weight = float(prior_weight)
        shape = (self.n_envs, self.n_arms)
        self._x, self._xx, self._xc, self._cc = (np.zeros(shape) for _ in range(4))

    def _observe(self, r: np.ndarray, c: np.ndarray, pulled: np.ndarray | None, context: Context) -> None:
        if self.discount < 1.0:
            for sums in (self._x, self._xx, self._xc, self._cc, self._counts, self._sums,
                         self._cost_sums):
                sums *= self.discount
        seen = ~np.isnan(r)
        x = np.where(seen, np.nan_to_num(r) * np.nan_to_num(c), 0.0)
        cost = np.where(seen, np.nan_to_num(c), 0.0)
        self._x += x
        self._xx += x * x
        self._xc += x * cost
        self._cc += cost * cost
        super()._observe(r, c, pulled, context)

    def _estimates(self) -> np.ndarray:
        return np.divide(self._x, self._cost_sums, out=np.zeros_like(self._x),
                         where=self._cost_sums > 0)

    def _sd(self) -> np.ndarray:
        """Standard error of the ratio estimate (0 where fewer than two observations)."""
        rate, n = self._estimates(), self._counts
        resid = np.maximum(self._xx - 2.0 * rate * self._xc + rate * rate * self._cc, 0.0)
        dof = np.maximum(n - 1.0, 0.0)
        pooled = resid.sum(axis=1, keepdims=True) / np.maximum(dof.sum(axis=1, keepdims=True), 1.0)
        sigma2 = (resid + self.prior_weight * pooled) / np.maximum(dof + self.prior_weight, 1e-12)
        var = np.divide(n * sigma2, self._cost_sums ** 2, out=np.zeros_like(resid),
                        where=(n > 1) & (self._cost_sums > 0))
        return np.sqrt(var)

    def _scores(self, context: Context) -> np.ndarray:
        z = np.stack([g.standard_normal(self.n_arms) for g in self.rngs])
        draw = self._estimates() + self.explore * self._sd() * z
        return np.where(self._counts < self.min_pulls, np.inf, draw)
