"""Fused Triton backend of exact speculative verification.

``verify`` has the reference's contract (flashspec.verify.reference.verify) and draws the same
counter-based random numbers, so both return the same tokens and counts for the same seed
(up to float rounding of the log-sum-exp, which can only matter when a log-space accept test
or the race is decided by less than ~1e-6). No host synchronisation happens inside on CUDA:
the seed may be a device int64 scalar, and invalid input cannot raise there. Instead a row
whose logits hold NaN or +inf (or are all -inf, or overflow when divided by T), whose
temperature is negative, or whose draft token is outside [0, V) is *poisoned*:
n_accepted = -1 and every output token -1; the engine checks ``n_accepted.min() < 0`` when
it reads the counts anyway. On CPU tensors (TRITON_INTERPRET=1) poisoned rows raise
FloatingPointError like the reference.

What is not fused falls back to the reference with a logged reason (once per reason):
top-p < 1, top-k > 256, top-k on CUDA (see FUSE_TOPK_ON_CUDA), dtypes other than bf16/fp16/fp32, V >= 2^24, CPU tensors without
TRITON_INTERPRET=1. Concurrent calls on different CUDA streams of one device are not
supported (the fused path keeps one set of per-row-group counters per device).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from flashspec.verify import reference
from flashspec.verify.sampling import SamplingParams
from flashspec.verify import triton_kernels as K

log = logging.getLogger("flashspec.verify.triton")

MAX_TOPK = 256
# On an H200 the fused top-k path disagreed with the reference on 0.2-0.4 % of rows at B=64
# (top-k 20/50; no mismatch without top-k), while the interpreter agrees on CPU. Until that is
# understood, top-k on CUDA falls back to the reference (exact by definition).
FUSE_TOPK_ON_CUDA = False
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_LOGGED: set[str] = set()
_COUNTERS: dict[tuple[str, str], torch.Tensor] = {}
INTERPRET = type(K.stats_kernel).__name__ == "InterpretedFunction"
FUSED = True            # last-program-per-row-group merge (atomic counters) vs separate kernels


@dataclass(frozen=True)
class Plan:
    """Launch geometry of one call."""

    rows: int           # batch rows per program (1 on the GPU)
    chunk: int          # vocabulary elements per pass-1 program
    block: int          # tile inside a chunk
    rchunk: int         # vocabulary elements per pass-2 program
    rblock: int
    warps: int
    rwarps: int


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _bucket(n: int) -> int:
    """Padded chunk count of the merge loads: few distinct values, so few compilations."""
    return _next_pow2(n) if INTERPRET else max(64, _next_pow2(n))


def plan(batch: int, gamma: int, vocab: int, interpret: bool = INTERPRET,
         n_sm: int = 132) -> Plan:
    """Chunking: on the GPU enough programs to fill it at B=1; in the interpreter few, big ones."""
    if interpret:
        block = min(_next_pow2(vocab), 32768)
        rows = max(1, min(_next_pow2(batch), (1 << 20) // block))
        return Plan(rows, block, block, block, block, 4, 4)
    positions = batch * (gamma + 1)
    chunk = 1024
    for c in (4096, 2048):
        if positions * math.ceil(vocab / c) >= 4 * n_sm:
            chunk = c
            break
    rchunk = 512
    for c in (2048, 1024):
        if batch * math.ceil(vocab / c) >= 2 * n_sm:
            rchunk = c
            break
    return Plan(1, chunk, min(chunk, 4096), rchunk, min(rchunk, 1024),
                8 if chunk >= 4096 else 4, 4)


def _fallback_reason(target_logits: torch.Tensor, draft_logits: torch.Tensor | None,
                     params: SamplingParams) -> str | None:
    vocab = target_logits.shape[-1]
    if params.top_p < 1.0:
        return "top-p is not fused"
    if 0 < params.top_k < vocab and params.top_k > MAX_TOPK:
        return f"top-k > {MAX_TOPK} is not fused"
    if 0 < params.top_k < vocab and target_logits.is_cuda and not FUSE_TOPK_ON_CUDA:
        return "fused top-k is disabled on CUDA (mismatched the reference on an H200)"
    for t in (target_logits, draft_logits):
        if t is not None and t.dtype not in _DTYPES:
            return f"logits dtype {t.dtype} is not fused (bf16/fp16/fp32 are)"
    if vocab >= 1 << 24:
        return "vocabularies of 2^24 or more tokens are not fused"
    if target_logits.device.type == "cpu" and not INTERPRET:
        return "CPU tensors need TRITON_INTERPRET=1 set before triton is imported"
    return None


def _log_once(reason: str) -> None:
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        log.warning("triton verify falls back to the torch reference: %s", reason)


def _counters(device: torch.device, kind: str, n: int) -> torch.Tensor:
    """Zeroed int32 counters per row group, kept per device; the kernels leave them at 0."""
    key = (str(device), kind)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def _check(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
           draft_logits: torch.Tensor | None) -> None:
    if target_logits.dim() != 3 or draft_tokens.dim() != 2:
        raise ValueError("expected target_logits [B, γ+1, V] and draft_tokens [B, γ]")
    b, g = draft_tokens.shape
    if tuple(target_logits.shape[:2]) != (b, g + 1):
        raise ValueError(f"target_logits {tuple(target_logits.shape)} does not match "
                         f"draft_tokens {tuple(draft_tokens.shape)}: need [B, γ+1, V]")
    if draft_logits is not None and tuple(draft_logits.shape) != (b, g, target_logits.shape[2]):
        raise ValueError(f"draft_logits {tuple(draft_logits.shape)} must be [B, γ, V]")


def _seed_args(seed: int | torch.Tensor, device: torch.device, dummy: torch.Tensor):
    """(seed_ptr tensor, int32 seed, from_ptr) without reading a device tensor on the host."""
    if isinstance(seed, torch.Tensor):
        if seed.numel() != 1:
            raise ValueError("seed tensor must hold one element")
        if seed.device != device:
            seed = seed.to(device)
        return seed.to(torch.int64), 0, True
    s = int(seed) & 0xFFFFFFFF
    return dummy, s - (1 << 32) if s >= 1 << 31 else s, False


def verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
           draft_logits: torch.Tensor | None, params: SamplingParams,
           seed: int | torch.Tensor = 0, temperature: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused verification: (out_tokens [B, γ+1] int64 padded with -1, n_accepted [B] int64)."""
    reason = _fallback_reason(target_logits, draft_logits, params)
    if reason is not None:
        _log_once(reason)
        return reference.verify(target_logits, draft_tokens, draft_logits, params, seed,
                                temperature=temperature)
    _check(target_logits, draft_tokens, draft_logits)
    out, nacc = launch(target_logits, draft_tokens, draft_logits, params, seed, temperature)
    if target_logits.device.type == "cpu" and bool((nacc < 0).any()):
        raise FloatingPointError("logits contain NaN or +inf (or a row is all -inf), a "
                                 "temperature is negative or a draft token is out of range")
    return out, nacc


def launch(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
           draft_logits: torch.Tensor | None, params: SamplingParams,
           seed: int | torch.Tensor = 0, temperature: torch.Tensor | None = None,
           fused: bool | None = None, geometry: Plan | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernels (no fallback, no host sync); poisoned rows have n_accepted = -1."""
    batch, gamma = draft_tokens.shape
    vocab = target_logits.shape[-1]
    device = target_logits.device
    out = torch.empty((batch, gamma + 1), dtype=torch.int64, device=device)
    nacc = torch.empty((batch,), dtype=torch.int64, device=device)
    if batch == 0:
        return out, nacc
    tgt = target_logits if target_logits.stride(-1) == 1 else target_logits.contiguous()
    has_q = draft_logits is not None
    drf = tgt if not has_q else (draft_logits if draft_logits.stride(-1) == 1
                                 else draft_logits.contiguous())
    temp_ptr, temp = tgt, float(params.temperature)
    if temperature is not None:
        temp_ptr = temperature.reshape(batch)
        if temp_ptr.device != device:
            temp_ptr = temp_ptr.to(device)
    seed_ptr, seed_i, seed_from_ptr = _seed_args(seed, device, tgt)
    topk = 0 < params.top_k < vocab
    p = geometry or plan(batch, gamma, vocab)
    fused = FUSED if fused is None else fused
    n_groups = -(-batch // p.rows)
    nc = -(-vocab // p.chunk)
    ncr = -(-vocab // p.rchunk)
    kp2 = _next_pow2(params.top_k) if topk else 1
    nct = -(-vocab // max(p.block, kp2)) if topk else 0
    rows_pq = batch * (gamma + 1) + batch * gamma
    size = (rows_pq * (3 * nc + 1) + batch * (int(K.N_ROWSTAT.value) + 4 * ncr) + rows_pq * nct * kp2)
    ws = torch.empty(size, dtype=torch.float32, device=device)
    cnt = _counters(device, "stats", n_groups) if fused else ws
    cnt_r = _counters(device, "race", n_groups) if fused else ws
    common = (tgt, tgt.stride(0), tgt.stride(1), drf, drf.stride(0), drf.stride(1), draft_tokens,
              draft_tokens.stride(0), draft_tokens.stride(1), temp_ptr, temp, seed_ptr, seed_i)
    flags = dict(HAS_Q=has_q, TOPK=topk, ROW_TEMP=temperature is not None,
                 SEED_PTR=seed_from_ptr, INTERPRET=INTERPRET)
    if topk:
        _launch_topk(p, tgt, drf, has_q, temp_ptr, temp, ws, batch, gamma, vocab, nc, ncr, nct,
                     kp2, params.top_k, temperature is not None)
    K.stats_kernel[(nc, n_groups, gamma + 1)](
        *common, ws, cnt, out, out.stride(0), nacc, batch, vocab, nc, ncr, G=gamma, ROWS=p.rows,
        CHUNK=p.chunk, BLOCK=p.block, NC_P2=_bucket(nc), FUSED=fused, num_warps=p.warps,
        **flags)
    if not fused:
        K.decide_kernel[(n_groups,)](
            *common, ws, out, out.stride(0), nacc, batch, vocab, nc, ncr, G=gamma, ROWS=p.rows,
            NC_P2=_bucket(nc), num_warps=4, **flags)
    K.race_kernel[(ncr, n_groups)](
        *common, ws, cnt_r, out, out.stride(0), batch, vocab, nc, ncr, G=gamma, ROWS=p.rows,
        CHUNK=p.rchunk, BLOCK=p.rblock, NCR_P2=_bucket(ncr), FUSED=fused,
        num_warps=p.rwarps, **flags)
    if not fused:
        K.finish_kernel[(n_groups,)](ws, out, out.stride(0), batch, nc, ncr, G=gamma,
                                     ROWS=p.rows, NCR_P2=_bucket(ncr), num_warps=4)
    return out, nacc


def _launch_topk(p: Plan, tgt: torch.Tensor, drf: torch.Tensor, has_q: bool, temp_ptr, temp,
                 ws: torch.Tensor, batch: int, gamma: int, vocab: int, nc: int, ncr: int,
                 nct: int, kp2: int, k: int, row_temp: bool) -> None:
    """Top-k thresholds (k-th largest of x/T) of every target and draft row-position."""
    block = max(p.block, kp2)
    nt_p2 = _next_pow2(nct * kp2)
    rows = p.rows if INTERPRET else 1
    for is_q, src, npos in ((False, tgt, gamma + 1), (True, drf, gamma)):
        if is_q and not has_q:
            continue
        groups = -(-batch * npos // rows)
        K.topk_cand_kernel[(nct, groups)](
            src, src.stride(0), src.stride(1), temp_ptr, temp, ws, batch, vocab, nc, ncr, nct,
            G=gamma, IS_Q=is_q, KP2=kp2, BLOCK=block, ROWS=rows, ROW_TEMP=row_temp,
            num_warps=8)
        K.topk_thr_kernel[(groups,)](ws, batch, nc, ncr, nct, k, G=gamma, IS_Q=is_q, KP2=kp2,
                                     NT_P2=nt_p2, ROWS=rows, num_warps=8)
