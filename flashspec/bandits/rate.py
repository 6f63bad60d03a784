"""Estimates of an arm's reward *rate*, Σ r·c / Σ c: reward per unit of cost.

With ``reward: tps`` (r = tokens / step seconds) and cost = the step's seconds, the rate is the
arm's pooled tokens per second, total tokens / total time: what a throughput run measures.
The mean of per-step tok/s is a different, biased target: a cheap step with a lucky acceptance
counts as much as an expensive one. :class:`RateStats` holds the estimate and its standard
error in the reward's own unit, so a policy on it needs no ``reward_scale`` (the same policy
fits a slow CPU and a fast GPU); UCB1 and Thompson sampling use it for ``reward: tps``,
:class:`RateThompson` for any reward.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from flashspec.bandits.base import Context, Policy
from flashspec.errors import FlashSpecError

# RateStats._pricing_var: how much wider than the pooled estimate the error of an arm's mean
# step time is after m own steps, as a factor 1 + SMALL_SAMPLE / m on its variance
SMALL_SAMPLE = 4.0


class RateStats:
    """Per replicate and arm: the ratio estimate R = X / C (X = Σ r·c, C = Σ c) and its standard
    error by the delta method, n · σ² / C², where σ² is the arm's residual variance
    Σ (x_i − R̂ c_i)² / (n − 1) over observed steps, shrunk towards the variance pooled over all
    arms with ``prior_weight`` pseudo-steps (two steps that happened to agree must not lock an
    arm out for good).

    Priors (:meth:`seed`) add pseudo-steps to the estimate and to n but not to the residuals: a
    stored rate says where the arm stands and how much evidence backs it, the variance is learned
    from this run's steps. Of a tok/s prior only the tokens carry over, not the seconds: a
    pseudo-step brings the tokens a step of that arm committed (rate x cost, which acceptance
    sets and no machine changes) and costs what a step of that arm costs *here*, its mean
    measured step time in this run (:meth:`step_cost`). Step times do not transfer: a CPU box
    runs several-fold faster or slower from one day to the next, and from one CPU to another
    the arms' costs move apart (drafting against verification), so a prior's tok/s ranking
    can be the wrong one on another machine. An arm not yet played here borrows the prior's
    step time scaled by this run's against the prior's over the arms played so far (1 before
    any step); UCB1 and Thompson sampling play it once to time it (:meth:`unmeasured`), and the
    rate's spread carries the error of that pricing while few own steps back it (:meth:`sd`). The
    per-context :class:`RateThompson` does not time an arm first: one timing step per arm and
    context would cost more than its priors save on a mixed stream.
    ``discount`` < 1 fades every sum by that factor per update (a memory of about
    1 / (1 − discount) steps)."""

    def __init__(self, shape: tuple[int, int], prior_weight: float = 1.0,
                 discount: float = 1.0) -> None:
        self.prior_weight, self.discount = float(prior_weight), float(discount)
        self.n, self.x, self.c, self.seen, self.xx, self.xc, self.cc = (
            np.zeros(shape) for _ in range(7))
        self.prior_x, self.prior_c = np.zeros(shape), np.zeros(shape)   # pseudo-steps (seed)
        self.prior_step = np.ones(shape)         # the prior's seconds per step of each arm
        # never faded: steps observed, and pseudo-steps seeded (what backs an arm at all)
        self.steps, self.seeded = np.zeros(shape), np.zeros(shape)

    def observe(self, r: np.ndarray, c: np.ndarray) -> None:
        """One round: ``r`` rewards and ``c`` costs, NaN where an arm was not observed."""
        if self.discount < 1.0:
            for sums in (self.n, self.x, self.c, self.seen, self.xx, self.xc, self.cc,
                         self.prior_x, self.prior_c):
                sums *= self.discount
        seen = ~np.isnan(r)
        with np.errstate(invalid="ignore"):   # unobserved entries are NaN, and dropped
            x = np.where(seen, r * c, 0.0)   # observed ones finite, costs > 0: Policy._check
        cost = np.where(seen, c, 0.0)
        self.n += seen
        self.seen += seen
        self.steps += seen
        self.x += x
        self.c += cost
        self.xx += x * x
        self.xc += x * cost
        self.cc += cost * cost

    def seed(self, n: np.ndarray, mean: np.ndarray, cost: np.ndarray) -> None:
        """``n[k]`` pseudo-steps of rate ``mean[k]`` at cost ``cost[k]`` seconds a step: their
        tokens count as they are, their seconds at this run's step time (:meth:`step_cost`)."""
        cost = np.broadcast_to(np.asarray(cost, dtype=float), self.n.shape)
        self.n += n
        self.seeded += n
        self.prior_x += n * mean * cost
        self.prior_c += n * cost
        self.prior_step = np.where(np.broadcast_to(n, self.n.shape) > 0, cost, self.prior_step)

    def unmeasured(self) -> np.ndarray:
        """Arms seeded from a prior that this run has not stepped yet: their step time here is
        a guess (the prior's, scaled)."""
        return (self.seeded > 0) & (self.steps == 0)

    def step_cost(self) -> np.ndarray:
        """``[envs, arms]`` seconds a step of each arm takes in this run: its mean measured step
        time; an arm not played yet, the prior's scaled by this run's step times against the
        prior's over the arms played (the prior's own before any step)."""
        played = self.seen > 0
        own = np.divide(self.c, self.seen, out=np.zeros_like(self.c), where=played)
        both = played & (self.prior_c > 0)
        here = np.where(both, self.c, 0.0).sum(axis=1, keepdims=True)
        there = np.where(both, self.seen * self.prior_step, 0.0).sum(axis=1, keepdims=True)
        scale = np.divide(here, there, out=np.ones_like(here), where=there > 0)
        return np.where(played, own, self.prior_step * scale)

    def _prior_cost(self) -> np.ndarray | float:
        """The pseudo-steps' seconds at this run's step times (0 without priors)."""
        if not self.seeded.any():   # no priors (most runs): skip the arithmetic a step pays
            return 0.0
        return self.prior_c / self.prior_step * self.step_cost()

    def _seconds(self) -> np.ndarray:
        """Seconds behind each arm's rate: this run's steps and the pseudo-steps at its times."""
        return self.c + self._prior_cost()

    def rate(self, seconds: np.ndarray | None = None) -> np.ndarray:
        """Tokens over seconds per arm (``seconds``: :meth:`_seconds`, when the caller has it)."""
        c = self._seconds() if seconds is None else seconds
        x = self.x + self.prior_x
        return np.divide(x, c, out=np.zeros_like(x), where=c > 0)

    def estimate(self) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`rate` and :meth:`sd` from one reading of the arms' step times."""
        seconds = self._seconds()
        rate = self.rate(seconds)
        return rate, self.sd(rate, seconds)

    def sd(self, rate: np.ndarray | None = None, seconds: np.ndarray | None = None) -> np.ndarray:
        """Standard error of the rate (0 where fewer than two steps back it). Faded evidence
        (``discount``) widens it without bound: an arm two real steps backed stays open to a
        draw however long ago they were. With priors it also carries the error of pricing the
        pseudo-steps at the arm's mean step time here (:meth:`_pricing_var`). ``rate``,
        ``seconds``: when the caller has them."""
        seconds = self._seconds() if seconds is None else seconds
        rate = self.rate(seconds) if rate is None else rate
        resid = np.maximum(self.xx - 2.0 * rate * self.xc + rate * rate * self.cc, 0.0)
        dof = np.maximum(self.seen - 1.0, 0.0)
        pooled = resid.sum(axis=1, keepdims=True) / np.maximum(dof.sum(axis=1, keepdims=True), 1.0)
        sigma2 = (resid + self.prior_weight * pooled) / np.maximum(dof + self.prior_weight, 1e-12)
        var = np.divide(self.n * sigma2, seconds ** 2, out=np.zeros_like(resid),
                        where=(np.maximum(self.n, self.steps) > 1) & (seconds > 0))
        return np.sqrt(var + self._pricing_var(rate, seconds))

    def _pricing_var(self, rate: np.ndarray, seconds: np.ndarray) -> np.ndarray | float:
        """Variance of the rate from pricing the pseudo-steps at the arm's mean step time here,
        which only its own m steps measure: (R · s)² · cv² / m, s the pseudo-steps' share of the
        arm's seconds, cv² one step time's relative variance pooled over the arms' own steps,
        widened by (1 + SMALL_SAMPLE / m): step times are heavier-tailed than the pooled Gaussian
        says (a step that met a busy core, a prompt's first step), and the mean of one or two of
        them is not known to the pooled precision. With hundreds of pseudo-steps and one timing
        step, the residual term alone would read an arm whose one step ran slow as certain and
        never step it again; the widening also retries an arm whose timing step ran far slower
        than its others (tests/test_priors.py), for little extra exploration."""
        if not self.seeded.any():   # no priors (most runs): nothing is priced
            return 0.0
        played = self.seen > 0
        mean = np.divide(self.c, self.seen, out=np.zeros_like(self.c), where=played)
        dev = np.maximum(self.cc - self.seen * mean * mean, 0.0)        # Σ (c_i − c̄)² per arm
        rel = np.divide(dev, mean * mean, out=np.zeros_like(dev), where=mean > 0)
        dof = np.maximum(self.seen - 1.0, 0.0).sum(axis=1, keepdims=True)
        cv2 = rel.sum(axis=1, keepdims=True) / np.maximum(dof, 1.0)   # 0 until an arm repeats
        # seconds is this run's steps plus the pseudo-steps at its times (_seconds): their share
        share = np.divide(seconds - self.c, seconds, out=np.zeros_like(self.c), where=seconds > 0)
        few = 1.0 + SMALL_SAMPLE / np.maximum(self.seen, 1.0)
        return np.divide((rate * share) ** 2 * cv2 * few, self.seen, out=np.zeros_like(self.c),
                         where=played)

    def draw(self, rngs: Sequence[np.random.Generator], explore: float = 1.0) -> np.ndarray:
        """One Thompson draw per replicate and arm: R̂ + explore · sd · N(0, 1)."""
        z = np.stack([g.standard_normal(self.n.shape[1]) for g in rngs])
        rate, sd = self.estimate()
        return rate + explore * sd * z


class RateThompson(Policy):
    """Gaussian Thompson sampling on the ratio estimate R = X / C of :class:`RateStats`: each
    step plays the arm with the largest draw R̂ + explore · sd · N(0, 1); an arm seen fewer than
    ``min_pulls`` times plays first. Rewards are not squashed to [0, 1], so ``reward_scale``
    does not matter here.

    ``discount`` < 1 makes it a policy for streams whose best arm changes (a prompt stream that
    moves between code, chat and editing): before each update every arm's sums and counts are
    multiplied by it, so evidence fades with a memory of about 1 / (1 − discount) steps. An arm
    left alone sees its posterior widen as its evidence fades, and is tried again as often as
    its draws come out on top. ``min_pulls`` counts real steps (and priors), never faded ones:
    forcing a play each time an arm's faded count dips under it would try a far slower arm
    every few dozen steps however clear its loss.
    """

    name = "rate_thompson"
    takes_priors = True

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
        self.rates = RateStats((self.n_envs, self.n_arms), prior_weight, self.discount)

    def _observe(self, r: np.ndarray, c: np.ndarray, pulled: np.ndarray | None, context: Context) -> None:
        if self.discount < 1.0:   # the counts behind min_pulls fade too (RateStats fades its own)
            for sums in (self._counts, self._sums, self._cost_sums):
                sums *= self.discount
        super()._observe(r, c, pulled, context)

    def _scores(self, context: Context) -> np.ndarray:
        draw = self.rates.draw(self.rngs, self.explore)
        tried = self.rates.steps + self.rates.seeded
        return np.where(tried < self.min_pulls, np.inf, draw)
