"""Thompson sampling with Beta posteriors, stationary and discounted (non-stationary).

A fractional reward r ∈ [0, 1] (e.g. an acceptance rate) is turned into one Bernoulli(r)
trial before the Beta update (Agrawal & Goyal 2012), so the posterior stays Beta. A reward in
tokens per second (``reward: tps``) has no natural [0, 1] scale: there the posterior is the
Gaussian one of the arm's pooled rate (:class:`~flashspec.bandits.rate.RateStats`), in the
reward's own unit.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from flashspec.bandits.base import Context, Policy
from flashspec.bandits.rate import RateStats
from flashspec.errors import FlashSpecError


class ThompsonSampling(Policy):
    """Beta(prior_alpha + successes, prior_beta + failures) per arm; plays the largest draw.
    With ``reward: tps``: a draw from each arm's Gaussian rate posterior, every arm played
    ``min_pulls`` times first (with priors: once, to time its step on this machine).

    Steps of one prompt are not independent evidence: the prompt sets how much any arm
    accepts, so a few steps of an arm on a hard prompt read as a slow arm known precisely.
    Without priors an arm is therefore stepped once on each of its first ``min_prompts``
    prompts (a prompt starts where the engine's ``step`` context is 0: one generate call, a
    batch when B > 1) before its draw alone decides, and its residual variance is shrunk
    towards the pooled one with ``prior_weight`` pseudo-steps (:class:`RateStats`): a handful
    of steps that happened to agree must not narrow its posterior to nothing. Either alone
    leaves an arm judged on the first steps of one hard prompt locked out for a whole job in
    some runs (tests/test_bandits.py)."""

    name = "thompson"
    takes_priors = True

    def __init__(self, n_arms: int, seed: int | Sequence[int] = 0, prior_alpha: float = 1.0,
                 prior_beta: float = 1.0, min_pulls: int = 2, min_prompts: int = 3,
                 prior_weight: float = 20.0, **kw: float) -> None:
        super().__init__(n_arms, seed, **kw)
        if not (prior_alpha > 0 and prior_beta > 0) or int(min_pulls) < 1 \
                or int(min_prompts) < 1 or not prior_weight > 0:
            raise FlashSpecError(f"bandit={self.name}: prior_alpha={prior_alpha}, prior_beta="
                                 f"{prior_beta} and prior_weight={prior_weight} must be > 0, "
                                 f"min_pulls={min_pulls} and min_prompts={min_prompts} >= 1")
        self.prior_alpha, self.prior_beta = float(prior_alpha), float(prior_beta)
        self.min_pulls, self.min_prompts = int(min_pulls), int(min_prompts)
        shape = (self.n_envs, self.n_arms)
        self._succ = np.zeros(shape)
        self._fail = np.zeros(shape)
        if self.reward_kind == "tps":
            self.rates = RateStats(shape, prior_weight=prior_weight)
            self._prompts = np.zeros(shape)              # prompts each arm was stepped on
            self._on_prompt = np.zeros(shape, dtype=bool)   # ... and whether on the current one

    def _scores(self, context: Context) -> np.ndarray:
        if self.rates is not None:
            step = None if context is None else context.get("step")
            if step is not None:   # a replicate at its step 0 starts a prompt (scalar or [n_envs])
                self._on_prompt[np.broadcast_to(np.asarray(step) == 0, (self.n_envs,))] = False
            few = (self._prompts < self.min_prompts) & ~self._on_prompt & (self.rates.seeded == 0)
            first = (self._counts < self.min_pulls) | self.rates.unmeasured() | few
            return np.where(first, np.inf, self.rates.draw(self.rngs))
        a = self.prior_alpha + self._succ
        b = self.prior_beta + self._fail
        return np.stack([g.beta(a[i], b[i]) for i, g in enumerate(self.rngs)])

    def _trials(self, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Bernoulli(r) success / failure indicators for observed entries (0 elsewhere)."""
        u = self.uniforms.take(self.n_arms)
        seen = ~np.isnan(r)
        win = seen & (u < np.nan_to_num(self.unit(r)))
        return win.astype(float), (seen & ~win).astype(float)

    def _observe(self, r: np.ndarray, c: np.ndarray, pulled: np.ndarray | None, context: Context) -> None:
        if self.rates is None:   # a rate posterior is fed by the base class
            win, lose = self._trials(r)
            self._succ += win
            self._fail += lose
        else:
            seen = ~np.isnan(r)
            self._prompts += seen & ~self._on_prompt
            self._on_prompt |= seen
        super()._observe(r, c, pulled, context)

    def _seed_prior(self, n: np.ndarray, mean: np.ndarray, cost: np.ndarray) -> None:
        """n pseudo-trials at the prior's success rate: the Beta posterior a run with n steps
        of mean reward ``mean`` leaves on average (fractional counts, no Bernoulli draws)."""
        if self.rates is None:   # a rate posterior is seeded by the base class
            rate = self.unit(mean)
            self._succ += n * rate
            self._fail += n * (1.0 - rate)
        super()._seed_prior(n, mean, cost)

    @property
    def posterior_means(self) -> np.ndarray:
        """Posterior mean of each arm's success rate (reward / reward_scale)."""
        return self._squeeze(self._posterior_mean())

    def _posterior_mean(self) -> np.ndarray:
        a = self.prior_alpha + self._succ
        return a / (a + self.prior_beta + self._fail)


class DiscountedThompson(ThompsonSampling):
    """Discounted Thompson sampling (Raj & Kalyani 2017): every round all success / failure
    counts are multiplied by ``discount`` before the new trial is added, so old evidence fades
    with an effective memory of about 1 / (1 − discount) rounds.
    """

    name = "d_thompson"

    def __init__(self, n_arms: int, seed: int | Sequence[int] = 0, discount: float = 0.99,
                 prior_alpha: float = 1.0, prior_beta: float = 1.0, **kw: float) -> None:
        super().__init__(n_arms, seed, prior_alpha, prior_beta, **kw)
        if not 0.0 < discount <= 1.0:
            raise FlashSpecError(f"bandit=d_thompson: discount={discount} must lie in (0, 1]")
        self.discount = float(discount)
        if self.rates is not None:
            self.rates.discount = self.discount

    def _observe(self, r: np.ndarray, c: np.ndarray, pulled: np.ndarray | None, context: Context) -> None:
        self._succ *= self.discount
        self._fail *= self.discount
        super()._observe(r, c, pulled, context)

    def _estimates(self) -> np.ndarray:
        return self.reward_scale * self._posterior_mean() if self.rates is None else \
            super()._estimates()
