"""PyTorch reference of exact speculative verification: the readable definition.

For each row, draft token x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)),
tested in log space against the counter-based uniform u_j. At the first rejection a token
is drawn from the residual max(0, p - q) by an exponential race (argmax of
log r_v - log E_v with E_v = -log u_v; no normalisation); if every draft passes, the bonus
token is drawn from p_γ the same way. Greedy rows (temperature 0) accept while the draft
equals the target argmax and emit the argmax. p(x) = 0 never accepts; q(x) = 0 rejects.
"""
from __future__ import annotations

import torch

from flashspec.verify import rng
from flashspec.verify.sampling import SamplingParams, check_finite, warp_logprobs

NEG_INF = float("-inf")


def row_temperatures(params: SamplingParams, temperature: torch.Tensor | None, batch: int,
                     device: torch.device) -> torch.Tensor:
    """Per-row temperatures [B] (float32): the override tensor or the scalar repeated."""
    if temperature is None:
        return torch.full((batch,), float(params.temperature), device=device)
    t = temperature.to(device=device, dtype=torch.float32).reshape(batch)
    if (t < 0).any():
        raise ValueError("per-row temperature must be >= 0")
    return t


def warp_rows(logits: torch.Tensor, params: SamplingParams, temps: torch.Tensor) -> torch.Tensor:
    """warp_logprobs with a per-row temperature: rows of [B, L, V] scaled by temps[b]."""
    scale = torch.where(temps > 0, temps, torch.ones_like(temps)).view(-1, 1, 1)
    unit = SamplingParams(temperature=1.0, top_k=params.top_k, top_p=params.top_p)
    return warp_logprobs(logits.float() / scale, unit)


def draft_logprobs(draft_tokens: torch.Tensor, draft_logits: torch.Tensor | None,
                   params: SamplingParams, temps: torch.Tensor, vocab: int) -> torch.Tensor:
    """log q [B, γ, V]: warped draft logits, or a one-hot for deterministic proposals."""
    if draft_logits is None:
        onehot = torch.full((*draft_tokens.shape, vocab), NEG_INF, device=draft_tokens.device)
        return onehot.scatter(-1, draft_tokens.unsqueeze(-1), 0.0)
    return warp_rows(draft_logits, params, temps)


def residual_logweights(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """log max(0, p - q) elementwise; -inf where p <= q."""
    gap = logq - logp
    out = logp + torch.log1p(-torch.exp(torch.clamp(gap, max=0.0)))
    return torch.where(gap < 0, out, torch.full_like(out, NEG_INF))


def exponential_race(logw: torch.Tensor, seed, streams: torch.Tensor) -> torch.Tensor:
    """argmax_v log w_v - log E_v, E_v = -log u(seed, stream, v): a sample ∝ w (unnormalised)."""
    vocab = logw.shape[-1]
    idx = torch.arange(vocab, device=logw.device)
    u = rng.uniform(seed, streams.unsqueeze(-1), idx)
    return (logw - torch.log(-torch.log(u))).argmax(dim=-1)


def verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
           draft_logits: torch.Tensor | None, params: SamplingParams, seed: int | torch.Tensor = 0,
           temperature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact verification. Returns (out_tokens [B, γ+1] padded with -1, n_accepted [B])."""
    check_finite(target_logits, "target logits")
    if draft_logits is not None:
        check_finite(draft_logits, "draft logits")
    batch, gamma = draft_tokens.shape
    vocab = target_logits.shape[-1]
    device = target_logits.device
    temps = row_temperatures(params, temperature, batch, device)
    greedy = (temps == 0).view(-1, 1)

    logp = warp_rows(target_logits, params, temps)                       # [B, γ+1, V]
    if temperature is None and params.greedy:  # all rows greedy: no q, no random numbers needed
        return greedy_verify(logp, draft_tokens)
    logq = draft_logprobs(draft_tokens, draft_logits, params, temps, vocab)  # [B, γ, V]
    x = draft_tokens.long().unsqueeze(-1)
    lp_x = logp[:, :gamma].gather(-1, x).squeeze(-1)
    lq_x = logq.gather(-1, x).squeeze(-1)

    streams = (torch.arange(batch, device=device).view(-1, 1) * (gamma + 1)
               + torch.arange(gamma + 1, device=device).view(1, -1))          # [B, γ+1]
    u = rng.uniform(seed, streams[:, :gamma], torch.tensor(vocab, device=device))
    stochastic_ok = (torch.log(u) < lp_x - lq_x) & (lq_x > NEG_INF) & (lp_x > NEG_INF)
    greedy_ok = draft_tokens.long() == logp[:, :gamma].argmax(-1)
    accept = torch.where(greedy, greedy_ok, stochastic_ok)
    n_acc = accept.int().cumprod(dim=1).sum(dim=1)                        # [B]

    logw = logp.clone()
    logw[:, :gamma] = residual_logweights(logp[:, :gamma], logq)
    empty = torch.isneginf(logw).all(dim=-1, keepdim=True)                # rounding fallback
    logw = torch.where(empty, logp, logw)
    sampled = exponential_race(logw, seed, streams)                       # [B, γ+1]
    fix = torch.where(greedy, logp.argmax(-1), sampled)
    return assemble(draft_tokens, n_acc, fix), n_acc


def assemble(draft_tokens: torch.Tensor, n_acc: torch.Tensor, fix: torch.Tensor) -> torch.Tensor:
    """Output rows: the accepted drafts, then the correction/bonus token, then -1 padding."""
    gamma = draft_tokens.shape[1]
    pos = torch.arange(gamma + 1, device=fix.device).view(1, -1)
    n = n_acc.view(-1, 1)
    drafts = torch.cat([draft_tokens.long(), torch.zeros_like(n)], dim=1)
    return torch.where(pos < n, drafts, torch.where(pos == n, fix, torch.full_like(fix, -1)))


def greedy_verify(logp: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: accept while the draft is the target argmax, then emit the argmax."""
    best = logp.argmax(-1)
    accept = draft_tokens.long() == best[:, :draft_tokens.shape[1]]
    n_acc = accept.int().cumprod(dim=1).sum(dim=1)
    return assemble(draft_tokens, n_acc, best), n_acc
