"""Analytical models used by reports: SlimSpec's ρ_TPS and speculative-decoding expectations."""
from __future__ import annotations

import math
from typing import Sequence


def rho_tps(rho_tau: float, nu: float, kappa: float) -> float:
    """Predicted TPS ratio of a variant head: ρ_τ (1 + κ) / (1 + ν κ)."""
    return rho_tau * (1.0 + kappa) / (1.0 + nu * kappa)


def kappa(gamma: int, head_s: float, step_s: float) -> float:
    """κ: full-head time per step (γ calls of ``head_s``) / the rest of a step of ``step_s``."""
    return gamma * head_s / max(step_s - gamma * head_s, 1e-9)


def expected_tau(alpha: float, gamma: int) -> float:
    """Expected tokens per target forward for i.i.d. acceptance rate α: (1 − α^{γ+1}) / (1 − α)."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def lowrank_cost_ratio(rank: int, vocab: int, hidden: int) -> float:
    """Weight bytes (= FLOPs) of a rank-r head over the full head's: r (V + d) / (V d).

    This is the ν a purely bandwidth-bound head would reach (SlimSpec's ideal ν).
    """
    return rank * (vocab + hidden) / (vocab * hidden)


def equal_cost_keep(rank: int, vocab: int, hidden: int) -> int:
    """Truncation size k whose head has the weight bytes / FLOPs of a rank-r head: r (V + d) / d.

    Rounded to the nearest id count and capped at V (a rank close to d costs more than the
    full vocabulary).
    """
    return min(vocab, max(1, round(rank * (vocab + hidden) / hidden)))


def equal_cost_rank(keep: int, vocab: int, hidden: int) -> int:
    """Inverse of :func:`equal_cost_keep`: the rank with a k-token truncated head's cost."""
    return min(hidden, max(1, round(keep * hidden / (vocab + hidden))))


def arm_gaps(means: Sequence[float]) -> list[float]:
    """Gaps Δ_i = μ* − μ_i of each arm to the best arm."""
    best = max(means)
    return [best - m for m in means]


def ucb1_regret_bound(means: Sequence[float], horizon: int) -> float:
    """UCB1's expected-regret bound (Auer, Cesa-Bianchi & Fischer 2002, Theorem 1) for rewards
    in [0, 1]: Σ_{i: Δ_i > 0} 8 ln T / Δ_i + (1 + π²/3) Σ_i Δ_i."""
    gaps = [g for g in arm_gaps(means) if g > 0]
    log_t = math.log(max(int(horizon), 1))
    return sum(8.0 * log_t / g for g in gaps) + (1.0 + math.pi ** 2 / 3.0) * sum(gaps)


def bernoulli_kl(p: float, q: float) -> float:
    """KL(Bernoulli(p) ‖ Bernoulli(q)), with 0 log 0 = 0 and q clipped away from {0, 1}."""
    q = min(max(q, 1e-12), 1.0 - 1e-12)
    out = 0.0
    if p > 0:
        out += p * math.log(p / q)
    if p < 1:
        out += (1.0 - p) * math.log((1.0 - p) / (1.0 - q))
    return out


def lai_robbins_bound(means: Sequence[float], horizon: int) -> float:
    """Asymptotic regret lower bound for Bernoulli arms (Lai & Robbins 1985):
    ln T · Σ_{i: Δ_i > 0} Δ_i / KL(μ_i ‖ μ*). Reference only: it holds as T → ∞."""
    best = max(means)
    log_t = math.log(max(int(horizon), 1))
    return log_t * sum((best - m) / bernoulli_kl(m, best) for m in means if best - m > 0)
