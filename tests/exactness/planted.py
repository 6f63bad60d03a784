"""Planted bugs: a compact re-implementation of exact verification with one switch per bug.

``variant_verify(..., bug=None)`` is bit-identical to ``flashspec.verify.reference.verify``
(asserted in the tests), so each planted variant differs from the real rule by its bug alone.
"""
from __future__ import annotations

import functools

import torch

from flashspec.core import SamplingParams
from flashspec.verify import rng
from flashspec.verify.reference import (block_race, blocks_of, draft_logprobs, race_in_blocks,
                                        race_weights)
from flashspec.verify.sampling import warp_logprobs

NEG_INF = float("-inf")
BUGS = (
    "temperature_after_softmax",   # log_softmax(x) / T instead of log_softmax(x / T), p and q
    "q_temperature_mismatch",      # q rebuilt at T = 1 while drafts were sampled at T
    "residual_unclamped",          # residual weights |p − q|: the negative part is not zeroed
    "bonus_from_q",                # bonus token drawn from the last draft q instead of p_γ
    "first_rejection_off_by_one",  # the first rejected draft is emitted, residual one slot later
    "block_by_max",                # race block drawn ∝ its largest weight, not its mass
)


def make_verify(bug: str | None):
    """A verify function with the named planted bug (None: the correct rule)."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown planted bug {bug!r}")
    return functools.partial(variant_verify, bug=bug)


def _warp(logits: torch.Tensor, params: SamplingParams, bug: str | None) -> torch.Tensor:
    if bug == "temperature_after_softmax":
        unit = SamplingParams(1.0, params.top_k, params.top_p)
        return warp_logprobs(logits, unit) / params.temperature
    return warp_logprobs(logits, params)


def _logq(draft_tokens, draft_logits, params, vocab, bug) -> torch.Tensor:
    if draft_logits is not None and bug == "q_temperature_mismatch":
        return warp_logprobs(draft_logits, SamplingParams(1.0, params.top_k, params.top_p))
    if draft_logits is not None:
        return _warp(draft_logits, params, bug)
    ones = torch.ones(draft_tokens.shape[0])
    return draft_logprobs(draft_tokens, None, params, ones, vocab)


def _residual(logp: torch.Tensor, logq: torch.Tensor, bug: str | None) -> torch.Tensor:
    if bug != "residual_unclamped":
        return race_weights(logp, logq)
    return (torch.exp(logp) - torch.exp(logq)).abs()


def variant_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                   draft_logits: torch.Tensor | None, params: SamplingParams, seed: int = 0,
                   temperature: torch.Tensor | None = None, *, bug: str | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative verification (stochastic rows only) with an optional planted bug."""
    if params.temperature <= 0 or temperature is not None:
        raise ValueError("variant_verify covers a scalar temperature > 0 only")
    batch, gamma = draft_tokens.shape
    vocab = target_logits.shape[-1]
    logp = _warp(target_logits, params, bug)
    logq = _logq(draft_tokens, draft_logits, params, vocab, bug)
    x = draft_tokens.long().unsqueeze(-1)
    lp_x = logp[:, :gamma].gather(-1, x).squeeze(-1)
    lq_x = logq.gather(-1, x).squeeze(-1)
    streams = (torch.arange(batch).view(-1, 1) * (gamma + 1) + torch.arange(gamma + 1))
    u = rng.uniform(seed, streams[:, :gamma], torch.tensor(vocab))
    accept = (torch.log(u) < lp_x - lq_x) & (lq_x > NEG_INF) & (lp_x > NEG_INF)
    n_acc = accept.int().cumprod(dim=1).sum(dim=1)
    p = torch.exp(logp)
    w = p.clone()
    w[:, :gamma] = _residual(logp[:, :gamma], logq, bug)
    if bug == "bonus_from_q":
        w[:, gamma] = torch.exp(logq[:, gamma - 1])
    if bug == "block_by_max":
        fix = race_in_blocks(blocks_of(w).amax(-1), w, seed, streams)
    else:
        fix = block_race(w, p, seed, streams)
    if bug == "first_rejection_off_by_one":
        n_acc = torch.clamp(n_acc + 1, max=gamma)
    pos = torch.arange(gamma + 1).view(1, -1)
    n = n_acc.view(-1, 1)
    drafts = torch.cat([draft_tokens.long(), torch.zeros_like(n).long()], dim=1)
    out = torch.where(pos < n, drafts, torch.where(pos == n, fix, torch.full_like(fix, -1)))
    return out, n_acc
