"""EXP3 (Auer, Cesa-Bianchi, Freund & Schapire 2002): exponential weights for adversarial rewards."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from flashspec.bandits.base import Context, Policy
from flashspec.errors import FlashSpecError


def exp3_eta(n_arms: int, horizon: int) -> float:
    """Auer et al.'s tuning γ = min(1, sqrt(K ln K / ((e − 1) T))) for a known horizon T."""
    if n_arms < 2:
        return 1.0
    return min(1.0, math.sqrt(n_arms * math.log(n_arms) / ((math.e - 1.0) * max(horizon, 1))))


class EXP3(Policy):
    """Plays arm k with probability p_k = (1 − η) w_k / Σw + η / K; the played arm's weight grows
    by exp(η r̂ / K) with the importance-weighted reward r̂ = r / p_k. With full information
    every observed arm's weight grows by exp(η r / K) (no importance weight is needed).

    ``eta`` is the exploration rate; when None it is tuned from ``horizon``.
    """

    name = "exp3"

    def __init__(self, n_arms: int, seed: int | Sequence[int] = 0, eta: float | None = None,
                 horizon: int = 10000, **kw: float) -> None:
        super().__init__(n_arms, seed, **kw)
        eta = exp3_eta(self.n_arms, int(horizon)) if eta is None else float(eta)
        if not 0.0 < eta <= 1.0:
            raise FlashSpecError(f"bandit=exp3: eta={eta} must lie in (0, 1]")
        self.eta = eta
        self._logw = np.zeros((self.n_envs, self.n_arms))
        self._p: np.ndarray | None = None

    def _probs(self) -> np.ndarray:
        w = np.exp(self._logw - self._logw.max(axis=1, keepdims=True))
        return (1.0 - self.eta) * w / w.sum(axis=1, keepdims=True) + self.eta / self.n_arms

    def select_many(self, context: Context = None) -> np.ndarray:
        self._p = self._probs()
        u = self.uniforms.take(1)
        arms = (np.cumsum(self._p, axis=1) <= u).sum(axis=1)
        return np.minimum(arms, self.n_arms - 1)

    def _observe(self, r: np.ndarray, c: np.ndarray, pulled: np.ndarray | None, context: Context) -> None:
        x = np.nan_to_num(self.unit(r))
        if pulled is not None:  # bandit feedback: importance weight by the selection probability
            p = self._p if self._p is not None else self._probs()
            x = x / p
        self._logw += self.eta * x / self.n_arms
        self._logw -= self._logw.max(axis=1, keepdims=True)
        self._p = None
        super()._observe(r, c, pulled, context)

    @property
    def probabilities(self) -> np.ndarray:
        """Current selection probabilities."""
        return self._squeeze(self._probs())
