"""Synthetic, context-free logit tables: one target row and one draft row per absolute position.

Target logits are ``scale_p · z`` with z ~ N(0, 1); a drafter's logits are
``scale_q · (overlap · z + sqrt(1 − overlap²) · noise)``, so ``overlap`` ∈ [0, 1] controls how
much q agrees with p. A fraction of tokens gets p = 0 (target logit −inf; q keeps them, so
drafts of impossible tokens occur and must be rejected) and another q = 0 (reachable only
through the residual).
"""
from __future__ import annotations

import math

import torch

MASKED_P = 0.02
MASKED_Q = 0.02


def make_target(vocab: int, positions: int, scale: float = 2.5, masked: float = MASKED_P,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(target logits [P, V] float32 with −inf entries, the unscaled Gaussian z [P, V])."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn((positions, vocab), generator=gen)
    return (scale * z).masked_fill(_mask(z.shape, masked, gen), float("-inf")), z


def make_draft(z_target: torch.Tensor, overlap: float, scale: float = 2.0,
               masked: float = MASKED_Q, seed: int = 1) -> torch.Tensor:
    """Draft logits [P, V] correlated with the target's z by ``overlap``."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError("overlap must be in [0, 1]")
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(z_target.shape, generator=gen)
    z = overlap * z_target + math.sqrt(1.0 - overlap ** 2) * noise
    return (scale * z).masked_fill(_mask(z.shape, masked, gen), float("-inf"))


def _mask(shape: torch.Size, frac: float, gen: torch.Generator) -> torch.Tensor:
    """Random boolean mask of about ``frac`` of the entries; token 0 never masked."""
    mask = torch.rand(tuple(shape), generator=gen) < frac
    mask[:, 0] = False
    return mask
