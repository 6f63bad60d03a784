"""The logit warps and draws shared by drafters and verifiers.

Order is fixed everywhere: temperature on the raw logits, then top-k, then top-p, then
log-softmax. A drafter's q and the verifier's p go through this one function, so the two
sides can never disagree about the warp.
"""
from __future__ import annotations

import torch

from flashspec.core import SamplingParams
from flashspec.kernels import choose


def check_finite(logits: torch.Tensor, what: str) -> None:
    """Raise on NaN or +inf logits (-inf is a legal mask value)."""
    if torch.isnan(logits).any() or torch.isposinf(logits).any():
        raise FloatingPointError(f"{what} contain NaN or +inf; refusing to emit tokens")


def warp_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities (float32) after temperature, top-k and top-p, over the last dim."""
    x = logits.float()
    if not params.greedy:
        x = x / params.temperature
    return torch.log_softmax(mask_warps(x, params), dim=-1)


def mask_warps(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits with the tokens top-k and top-p drop set to -inf."""
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        x = _mask_top_p(x, params.top_p)
    return x


def _mask_top_p(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix of tokens (by descending prob) whose mass reaches top_p."""
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    probs = torch.softmax(sorted_x, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           seed: torch.Tensor | None = None, step: int = 0) -> torch.Tensor:
    """One token per row of ``logits`` [..., V] drawn from warp(logits); greedy: the argmax.

    With a device ``seed`` the draw is Gumbel-max over counter-based uniforms of (seed,
    stream = row * 64 + step), argmax of x * (1/T) - log(-log u) over the top-k/top-p masked
    logits x, instead of ``generator``: no torch RNG state, so a CUDA graph can replay it with
    a new seed. On a GPU the argmax and, without top-k/top-p, the whole draw run as the Triton
    kernels of :mod:`flashspec.verify.argmax` (the same bits; :mod:`flashspec.kernels`'
    ``argmax`` and ``gumbel_argmax``)."""
    if params.greedy:
        if choose("argmax", logits).triton:
            from flashspec.verify.argmax import row_argmax    # triton only on a GPU
            return row_argmax(logits)
        return logits.argmax(dim=-1)
    if seed is None:
        logp = warp_logprobs(logits, params)
        flat = logp.reshape(-1, logp.shape[-1])
        return torch.multinomial(flat.exp(), 1, generator=generator).reshape(logp.shape[:-1])
    if choose("gumbel_argmax", logits, params=params).triton:
        from flashspec.verify.argmax import gumbel_argmax
        return gumbel_argmax(logits, inverse_temperature(params.temperature), seed, step)
    return gumbel_draw(logits, params, seed, step)


def inverse_temperature(temperature: float) -> float:
    """1 / T rounded to float32 once: both forms of the counter-based draw scale the logits by
    this one number (torch's CUDA kernels divide by a scalar that way too)."""
    return float(torch.tensor(1.0 / temperature, dtype=torch.float32))


def gumbel_draw(logits: torch.Tensor, params: SamplingParams, seed: torch.Tensor, step: int
                ) -> torch.Tensor:
    """The torch form of ``sample``'s counter-based draw (any warp)."""
    from flashspec.verify import rng
    x = logits.float() * inverse_temperature(params.temperature)
    x = mask_warps(x, params)
    flat = x.reshape(-1, x.shape[-1])
    rows = torch.arange(flat.shape[0], device=flat.device)
    cols = torch.arange(flat.shape[1], device=flat.device)
    u = rng.uniform(seed, rows[:, None] * 64 + step, cols)
    return (flat - torch.log(-torch.log(u))).argmax(dim=-1).reshape(x.shape[:-1])
