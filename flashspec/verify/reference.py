"""PyTorch reference of exact speculative verification: the readable definition.

For each row, draft token x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)),
tested in log space against the counter-based uniform u_j. At the first rejection a token
is drawn from the residual w = max(0, p - q) by a two-level exponential race (no
normalisation): a block of RACE_BLOCK tokens by argmax_k log W_k - log E_k over the block
masses W_k, then a token of that block by argmax_v log w_v - log E_v (E = -log u, the
uniforms of the block level at indices V + 1 + k, of the token level at v). If every draft
passes, the bonus token is drawn from p_γ the same way. The two levels draw a block with
probability W_k / ΣW and a token of it with probability w_v / W_k: a token ∝ w_v, and only
the masses and one block need random numbers. Greedy rows (temperature 0) accept while the
draft equals the target argmax and emit the argmax. p(x) = 0 never accepts; q(x) = 0 rejects.
"""
from __future__ import annotations

import torch

from flashspec.core import SamplingParams
from flashspec.verify import rng
from flashspec.verify.sampling import check_finite, warp_logprobs

NEG_INF = float("-inf")
RACE_BLOCK = 1024        # tokens per block of the race (triton_kernels.RBLK)


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


def race_weights(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """The residual w = max(0, p - q) with p = exp(log p), q = exp(log q) in float32."""
    return torch.clamp(torch.exp(logp) - torch.exp(logq), min=0.0)


def blocks_of(w: torch.Tensor) -> torch.Tensor:
    """w [..., V] as [..., NB, RACE_BLOCK] race blocks, the last one padded with zeros."""
    vocab = w.shape[-1]
    nb = -(-vocab // RACE_BLOCK)
    return torch.nn.functional.pad(w, (0, nb * RACE_BLOCK - vocab)).unflatten(-1, (nb, RACE_BLOCK))


def block_race(w: torch.Tensor, p: torch.Tensor, seed, streams: torch.Tensor) -> torch.Tensor:
    """A token ∝ w (rows of [..., V]; ∝ p where a row of w is all 0) by the two-level race."""
    masses = blocks_of(w).sum(-1)
    empty = (masses == 0).all(dim=-1, keepdim=True)                       # rounding fallback
    return race_in_blocks(torch.where(empty, blocks_of(p).sum(-1), masses),
                          torch.where(empty, p, w), seed, streams)


def race_in_blocks(masses: torch.Tensor, w: torch.Tensor, seed, streams: torch.Tensor
                   ) -> torch.Tensor:
    """The block argmax_k log masses_k - log E_k (uniforms at V + 1 + k), then the token
    argmax_v log w_v - log E_v among that block's tokens (uniforms at v): random numbers are
    drawn for the block masses and the RACE_BLOCK tokens of the winning block only."""
    vocab = w.shape[-1]
    st = streams.unsqueeze(-1)
    blocks = torch.arange(masses.shape[-1], device=w.device)
    ub = rng.uniform(seed, st, vocab + 1 + blocks)
    block = (torch.log(masses) - torch.log(-torch.log(ub))).argmax(dim=-1, keepdim=True)
    idx = block * RACE_BLOCK + torch.arange(RACE_BLOCK, device=w.device)   # [..., RACE_BLOCK]
    inside = idx < vocab                                 # the last block is padded with w = 0
    w_block = torch.where(inside, w.gather(-1, idx.clamp(max=vocab - 1)),
                          torch.zeros((), device=w.device))
    keys = torch.log(w_block) - torch.log(-torch.log(rng.uniform(seed, st, idx)))
    return idx.gather(-1, keys.argmax(dim=-1, keepdim=True)).squeeze(-1)


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

    # the correction/bonus token is drawn at each row's stopping position only: the residual
    # max(0, p - q) at a rejection, p itself after γ acceptances (q = 0 there)
    at = n_acc.long().view(-1, 1)
    logp_n = logp.gather(1, at.unsqueeze(-1).expand(-1, 1, vocab)).squeeze(1)          # [B, V]
    logq_n = torch.full_like(logp_n, NEG_INF)
    if gamma > 0:
        logq_n = logq.gather(1, at.clamp(max=gamma - 1).unsqueeze(-1).expand(-1, 1, vocab))
        logq_n = torch.where(at == gamma, NEG_INF, logq_n.squeeze(1))
    sampled = block_race(race_weights(logp_n, logq_n), torch.exp(logp_n), seed,
                         streams.gather(1, at).squeeze(1))                                # [B]
    fix = torch.where(greedy.squeeze(1), logp_n.argmax(-1), sampled)
    return assemble(draft_tokens, n_acc, fix), n_acc


def assemble(draft_tokens: torch.Tensor, n_acc: torch.Tensor, fix: torch.Tensor) -> torch.Tensor:
    """Output rows: the accepted drafts, then the correction/bonus token fix [B], then -1
    padding."""
    gamma = draft_tokens.shape[1]
    pos = torch.arange(gamma + 1, device=fix.device).view(1, -1)
    n = n_acc.view(-1, 1)
    drafts = torch.cat([draft_tokens.long(), torch.zeros_like(n)], dim=1)
    return torch.where(pos < n, drafts, torch.where(pos == n, fix.view(-1, 1), -1))


def greedy_verify(logp: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: accept while the draft is the target argmax, then emit the argmax."""
    best = logp.argmax(-1)
    accept = draft_tokens.long() == best[:, :draft_tokens.shape[1]]
    n_acc = accept.int().cumprod(dim=1).sum(dim=1)
    return assemble(draft_tokens, n_acc, best.gather(1, n_acc.long().view(-1, 1))), n_acc

