"""Index policies: fixed arm, ε-greedy, UCB1, sliding-window UCB, and the simulation oracle."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from flashspec.bandits.base import Context, Policy
from flashspec.bandits.rate import RateStats
from flashspec.errors import FlashSpecError


class FixedArm(Policy):
    """Always plays ``arm`` (the static baseline: one drafter, one γ)."""

    name = "fixed"
    learns = False

    def __init__(self, n_arms: int, seed: int | Sequence[int] = 0, arm: int = 0, **kw: float) -> None:
        super().__init__(n_arms, seed, **kw)
        if not 0 <= int(arm) < self.n_arms:
            raise FlashSpecError(f"bandit=fixed: arm={arm} is outside [0, {self.n_arms}); "
                                 f"the drafter set has {self.n_arms} arms")
        self.arm = int(arm)

    def select_many(self, context: Context = None) -> np.ndarray:
        return np.full(self.n_envs, self.arm, dtype=np.int64)


class EpsilonGreedy(Policy):
    """Plays each arm once, then a uniformly random arm with probability ε, else the best mean."""

    name = "eps_greedy"
    takes_priors = True

    def __init__(self, n_arms: int, seed: int | Sequence[int] = 0, epsilon: float = 0.1, **kw: float) -> None:
        super().__init__(n_arms, seed, **kw)
        if not 0.0 <= epsilon <= 1.0:
            raise FlashSpecError(f"bandit=eps_greedy: epsilon={epsilon} must lie in [0, 1]")
        self.epsilon = float(epsilon)

    def select_many(self, context: Context = None) -> np.ndarray:
        u = self.uniforms.take(2)
        greedy = self.argmax(np.where(self._counts > 0, self._estimates(), np.inf))
        random_arm = np.minimum((u[:, 1] * self.n_arms).astype(np.int64), self.n_arms - 1)
        return np.where(u[:, 0] < self.epsilon, random_arm, greedy)


class UCB1(Policy):
    """UCB1 (Auer, Cesa-Bianchi & Fischer 2002): mean + c·sqrt(2 ln t / n); unplayed arms first.

    With ``reward: tps`` the index runs on the arm's pooled tokens per second
    (:class:`~flashspec.bandits.rate.RateStats`): R̂ + c·sqrt(2 ln t)·sd(R̂). The rate's standard
    error σ/(c̄·√n) stands where UCB1 has reward_scale/√n, so the bonus is in the reward's own
    unit and the same config explores alike on a CPU and on a GPU; each arm plays ``min_pulls``
    times first (a variance needs two steps), once with priors (to time its step here).
    """

    name = "ucb1"
    takes_priors = True

    def __init__(self, n_arms: int, seed: int | Sequence[int] = 0, c: float = 1.0,
                 min_pulls: int = 2, **kw: float) -> None:
        super().__init__(n_arms, seed, **kw)
        if not c >= 0 or int(min_pulls) < 1:
            raise FlashSpecError(f"bandit=ucb1: c={c} must be >= 0 and min_pulls={min_pulls} >= 1")
        self.c, self.min_pulls = float(c), int(min_pulls)
        if self.reward_kind == "tps":
            self.rates = RateStats((self.n_envs, self.n_arms))

    def _scores(self, context: Context) -> np.ndarray:
        # t counts plays: a warm start's pseudo-pulls are plays the bonus has already paid for
        t = max(self.t + self._prior_pulls, 1)
        if self.rates is None:
            return _ucb(self._estimates(), self._counts, t, self.c * self.reward_scale)
        rate, sd = self.rates.estimate()
        index = rate + self.c * np.sqrt(2.0 * np.log(t)) * sd
        # an arm a prior backs but this machine has not stepped: its step time here is unknown
        return np.where((self._counts < self.min_pulls) | self.rates.unmeasured(), np.inf, index)


class SlidingWindowUCB(Policy):
    """Sliding-window UCB (Garivier & Moulines 2011): UCB1 on the last ``window`` rounds only."""

    name = "sw_ucb"

    def __init__(self, n_arms: int, seed: int | Sequence[int] = 0, window: int = 500, c: float = 1.0,
                 **kw: float) -> None:
        super().__init__(n_arms, seed, **kw)
        if int(window) < 1 or not c >= 0:
            raise FlashSpecError(f"bandit=sw_ucb: window={window} must be >= 1 and c={c} >= 0")
        self.window, self.c = int(window), float(c)
        self._hist = np.full((self.window, self.n_envs, self.n_arms), np.nan)
        self._win_n = np.zeros((self.n_envs, self.n_arms))
        self._win_sum = np.zeros((self.n_envs, self.n_arms))

    def _observe(self, r: np.ndarray, c: np.ndarray, pulled: np.ndarray | None, context: Context) -> None:
        slot = self.t % self.window
        old = self._hist[slot]
        self._win_n -= ~np.isnan(old)
        self._win_sum -= np.nan_to_num(old)
        self._hist[slot] = r
        self._win_n += ~np.isnan(r)
        self._win_sum += np.nan_to_num(r)
        super()._observe(r, c, pulled, context)
        if self.t % self.window == 0:  # drop accumulated rounding from add/subtract
            self._win_sum = np.nansum(self._hist, axis=0)

    def _estimates(self) -> np.ndarray:
        return np.divide(self._win_sum, self._win_n, out=np.zeros_like(self._win_sum),
                         where=self._win_n > 0)

    def _scores(self, context: Context) -> np.ndarray:
        horizon = max(min(self.t, self.window), 1)
        return _ucb(self._estimates(), self._win_n, horizon, self.c * self.reward_scale)


class Oracle(Policy):
    """Knows the true means (simulation only): ``means`` is ``[K]`` or per-round ``[T, K]``.

    With a per-round table the oracle plays the best arm of row ``t`` (its own update count),
    which covers change points and per-step domains; past the table's end the last row holds.
    """

    name = "oracle"

    def __init__(self, n_arms: int, seed: int | Sequence[int] = 0,
                 means: Sequence[float] | np.ndarray | None = None, **kw: float) -> None:
        super().__init__(n_arms, seed, **kw)
        if means is None:
            raise FlashSpecError("bandit=oracle needs the true arm means (means=[...]); "
                                 "it exists for simulations, not for real decoding")
        table = np.atleast_2d(np.asarray(means, dtype=float))
        if table.shape[1] != self.n_arms:
            raise FlashSpecError(f"bandit=oracle: means has {table.shape[1]} arms, expected {self.n_arms}")
        self.best = table.argmax(axis=1)

    def select_many(self, context: Context = None) -> np.ndarray:
        return np.full(self.n_envs, self.best[min(self.t, len(self.best) - 1)], dtype=np.int64)


def _ucb(mean: np.ndarray, n: np.ndarray, t: float, scale: float) -> np.ndarray:
    """mean + scale·sqrt(2 ln t / n), +inf where n = 0."""
    bonus = scale * np.sqrt(2.0 * np.log(t) / np.maximum(n, 1e-12))
    return np.where(n > 0, mean + bonus, np.inf)
