"""Analytical models used by reports: SlimSpec's ρ_TPS and speculative-decoding expectations."""
from __future__ import annotations


def rho_tps(rho_tau: float, nu: float, kappa: float) -> float:
    """Predicted TPS ratio of a variant head: ρ_τ (1 + κ) / (1 + ν κ)."""
    return rho_tau * (1.0 + kappa) / (1.0 + nu * kappa)


def expected_tau(alpha: float, gamma: int) -> float:
    """Expected tokens per target forward for i.i.d. acceptance rate α: (1 − α^{γ+1}) / (1 − α)."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)
