"""Row argmax, counter-based Gumbel-max draws, and the top k (or k Gumbel top-k draws without
replacement) with their log-probabilities over a wide vocabulary, each in two small Triton
kernels (drafting on a GPU).

``torch.argmax`` of one [1, 49152] bf16 row runs as a single-block reduction, about 13 µs on
an H200: the slowest kernel of a greedy EAGLE draft pass. A sampled draft was worse: the
counter-based uniforms of :mod:`flashspec.verify.rng` cost a dozen int64 element-wise kernels
over the row, then two logs, a subtraction and the argmax. Here every program reduces one block
of ``BLOCK`` columns of a row to its (max, first index of the max), computing the Gumbel keys
on the fly, and a second kernel reduces a row's blocks. Ties go to the smallest index, as with
``torch.argmax``; the result is clamped into [0, V), so a NaN row cannot yield an out-of-range
token id. The draws are bit for bit those of :func:`flashspec.verify.sampling.sample`'s
torch path (same uniforms, same float32 operations in the same order).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashspec.options import interpreted
from flashspec.verify.triton_kernels import _load_seed, _log, _stream_key, _uniform

BLOCK = 1024


@triton.jit
def _block_max_kernel(x_ptr, val_ptr, idx_ptr, seed_ptr, V, n_blocks, inv_t, step,
                      GUMBEL: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * V + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
    if GUMBEL:   # x / T - log(-log u): a draw from softmax(x / T) by Gumbel-max
        key = _stream_key(_load_seed(seed_ptr, 0, True), row * 64 + step, INTERPRET)
        u = _uniform(key, cols, INTERPRET)
        x = x * inv_t - _log(-_log(u, INTERPRET), INTERPRET)
    m = tl.max(x, axis=0)
    first = tl.min(tl.where(x == m, cols, V), axis=0)
    tl.store(val_ptr + row * n_blocks + blk, m)
    tl.store(idx_ptr + row * n_blocks + blk, first)


@triton.jit
def _row_max_kernel(val_ptr, idx_ptr, out_ptr, V, n_blocks, NB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, NB)
    v = tl.load(val_ptr + row * n_blocks + b, mask=b < n_blocks, other=-float("inf"))
    i = tl.load(idx_ptr + row * n_blocks + b, mask=b < n_blocks, other=V)
    m = tl.max(v, axis=0)
    best = tl.min(tl.where(v == m, i, V), axis=0)
    tl.store(out_ptr + row, tl.minimum(best, V - 1).to(tl.int64))


@triton.jit
def _block_topk_kernel(x_ptr, val_ptr, idx_ptr, m_ptr, s_ptr, seed_ptr, stream_ptr, V, n_blocks,
                       inv_t, K: tl.constexpr, KP2: tl.constexpr, BLOCK: tl.constexpr,
                       GUMBEL: tl.constexpr, INTERPRET: tl.constexpr):
    """Per (row, block): the block's top K keys (value, column; ties to the smaller column) and
    the (max, Σ exp(y - max)) of y = x · inv_t for the row's log-sum-exp. The keys are y, or
    with GUMBEL y - log(-log u), u the counter-based uniforms of the row's stream."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    y = tl.load(x_ptr + row * V + cols, mask=ok, other=-float("inf")).to(tl.float32) * inv_t
    m = tl.max(y, axis=0)
    safe = tl.where(m == -float("inf"), 0.0, m)
    tl.store(m_ptr + row * n_blocks + blk, m)
    tl.store(s_ptr + row * n_blocks + blk, tl.sum(tl.exp(y - safe), axis=0))
    x = y
    if GUMBEL:
        key = _stream_key(_load_seed(seed_ptr, 0, True), tl.load(stream_ptr + row), INTERPRET)
        x = y - _log(-_log(_uniform(key, cols, INTERPRET), INTERPRET), INTERPRET)
    slot = tl.arange(0, KP2)
    vals = tl.full([KP2], -float("inf"), tl.float32)
    idx = tl.full([KP2], V, tl.int32)
    for j in range(K):
        top = tl.max(x, axis=0)
        first = tl.min(tl.where((x == top) & ok, cols, V), axis=0)
        vals = tl.where(slot == j, top, vals)
        idx = tl.where(slot == j, first, idx)
        ok = ok & (cols != first)
        x = tl.where(cols == first, -float("inf"), x)
    out = (row * n_blocks + blk) * KP2 + slot
    tl.store(val_ptr + out, vals)
    tl.store(idx_ptr + out, idx)


@triton.jit
def _rounded(x, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``x`` rounded to DT (to nearest, ties to even), returned as fp32. Triton's
    interpreter truncates fp32 -> bf16 casts, so there the rounding is done on the bits."""
    if INTERPRET and DT == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)
    return x.to(DT).to(tl.float32)


@triton.jit
def _lowrank_block_topk_kernel(h_ptr, wd_ptr, wu_ptr, val_ptr, idx_ptr, m_ptr, s_ptr, M, D, R, V,
                               n_blocks, n_progs, s_wdr, s_wdd, s_wuv, s_wur, inv_t,
                               K: tl.constexpr, KP2: tl.constexpr, BD: tl.constexpr,
                               BR: tl.constexpr, BN: tl.constexpr, SUB: tl.constexpr,
                               UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Rows 16 g .. 16 g + 15 of h [M, D], vocabulary blocks SUB p .. SUB p + SUB - 1 (BN wide):
    u = h W_down^T and y = (u W_up^T) · inv_t, each rounded to h's dtype as ``LowRankHead``'s
    two matmuls write them, never stored; per block the top K of y (value, column; ties to the
    smaller column), per program the (max, Σ exp(y - max)) of its blocks."""
    p = tl.program_id(0)
    rows = tl.program_id(1) * 16 + tl.arange(0, 16)
    rm = rows < M
    r64 = rows.to(tl.int64)
    rr = tl.arange(0, BR)
    dt = h_ptr.dtype.element_ty
    u = tl.zeros([16, BR], tl.float32)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        x = tl.load(h_ptr + r64[:, None] * D + dd[None, :], mask=rm[:, None] & (dd < D)[None, :],
                    other=0.0)
        w = tl.load(wd_ptr + rr[None, :] * s_wdr + dd[:, None] * s_wdd,
                    mask=(rr < R)[None, :] & (dd < D)[:, None], other=0.0)
        if UPCAST:       # the interpreter's tl.dot has no bf16
            u += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif IEEE:
            u += tl.dot(x, w, input_precision="ieee")
        else:
            u += tl.dot(x, w)
    if UPCAST:       # u stays fp32 holding dt values: the interpreter's tl.dot has no bf16
        u = _rounded(u, dt, True)
    else:
        u = u.to(dt)
    m_run = tl.full([16], -float("inf"), tl.float32)
    s_run = tl.zeros([16], tl.float32)
    slot = tl.arange(0, KP2)[None, :]
    for j in range(SUB):
        blk = p * SUB + j
        cols = blk * BN + tl.arange(0, BN)
        ok = cols < V
        w = tl.load(wu_ptr + cols[None, :].to(tl.int64) * s_wuv + rr[:, None] * s_wur,
                    mask=(rr < R)[:, None] & ok[None, :], other=0.0)
        if UPCAST:
            z = tl.dot(u, w.to(tl.float32), input_precision="ieee")
        elif IEEE:
            z = tl.dot(u, w, input_precision="ieee")
        else:
            z = tl.dot(u, w)
        y = tl.where(ok[None, :], _rounded(z, dt, UPCAST) * inv_t, -float("inf"))
        m_new = tl.maximum(m_run, tl.max(y, 1))
        safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        s_run = s_run * tl.exp(m_run - safe) + tl.sum(tl.exp(y - safe[:, None]), 1)
        m_run = m_new
        vals = tl.full([16, KP2], -float("inf"), tl.float32)
        idx = tl.full([16, KP2], V, tl.int32)
        for kk in range(K):
            top = tl.max(y, 1)
            first = tl.min(tl.where(y == top[:, None], cols[None, :], V), 1)
            vals = tl.where(slot == kk, top[:, None], vals)
            idx = tl.where(slot == kk, first[:, None], idx)
            y = tl.where(cols[None, :] == first[:, None], -float("inf"), y)
        out = (r64[:, None] * n_blocks + blk) * KP2 + slot
        live = (rm & (rows * 0 + blk < n_blocks))[:, None] & (slot < KP2)
        tl.store(val_ptr + out, vals, mask=live)
        tl.store(idx_ptr + out, idx, mask=live)
    tl.store(m_ptr + r64 * n_progs + p, m_run, mask=rm)
    tl.store(s_ptr + r64 * n_progs + p, s_run, mask=rm)


@triton.jit
def _row_topk_kernel(x_ptr, val_ptr, idx_ptr, m_ptr, s_ptr, tok_ptr, lp_ptr, V, n_blocks, n_stats,
                     inv_t, K: tl.constexpr, KP2: tl.constexpr, NB: tl.constexpr,
                     NS: tl.constexpr, FROM_KEYS: tl.constexpr):
    """Per row: the top K keys of its blocks' candidates, with log-probabilities
    x · inv_t - lse (x read again at the K chosen columns; FROM_KEYS: the keys are x · inv_t)
    from the row's ``n_stats`` (max, Σ exp) pairs."""
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, NS)
    bm = tl.load(m_ptr + row * n_stats + b, mask=b < n_stats, other=-float("inf"))
    bs = tl.load(s_ptr + row * n_stats + b, mask=b < n_stats, other=0.0)
    big = tl.max(bm, axis=0)
    safe = tl.where(big == -float("inf"), 0.0, big)
    lse = safe + tl.log(tl.sum(bs * tl.exp(bm - safe), axis=0))
    c = tl.arange(0, NB * KP2)
    live = c < n_blocks * KP2
    v = tl.load(val_ptr + row * n_blocks * KP2 + c, mask=live, other=-float("inf"))
    i = tl.load(idx_ptr + row * n_blocks * KP2 + c, mask=live, other=V)
    for j in range(K):
        top = tl.max(v, axis=0)
        first = tl.min(tl.where(v == top, i, V), axis=0)
        at = tl.min(tl.where((v == top) & (i == first), c, NB * KP2), axis=0)
        col = tl.minimum(first, V - 1)
        if FROM_KEYS:
            y = top
        else:
            y = tl.load(x_ptr + row * V + col).to(tl.float32) * inv_t
        tl.store(tok_ptr + row * K + j, col.to(tl.int64))
        tl.store(lp_ptr + row * K + j, y - lse)
        v = tl.where(c == at, -float("inf"), v)
        i = tl.where(c == at, V, i)


INTERPRET = interpreted(_block_max_kernel)   # how the kernels were built (not a switch)


def _reduce(x: torch.Tensor, seed: torch.Tensor | None, inv_t: float, step: int) -> torch.Tensor:
    shape, vocab = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, vocab).contiguous()
    rows, n_blocks = flat.shape[0], triton.cdiv(vocab, BLOCK)
    vals = torch.empty(rows, n_blocks, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, n_blocks, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.long, device=x.device)
    if rows:
        seed_t = seed if seed is not None else out   # a valid pointer the kernel never reads
        _block_max_kernel[(rows, n_blocks)](flat, vals, idx, seed_t, vocab, n_blocks, inv_t, step,
                                            GUMBEL=seed is not None, BLOCK=BLOCK,
                                            INTERPRET=INTERPRET)
        _row_max_kernel[(rows,)](vals, idx, out, vocab, n_blocks,
                                 NB=triton.next_power_of_2(n_blocks))
    return out.reshape(shape)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` (int64, first index of the max) of ``x`` [..., V]."""
    return _reduce(x, None, 1.0, 0)


def gumbel_argmax(logits: torch.Tensor, inv_t: float, seed: torch.Tensor, step: int
                  ) -> torch.Tensor:
    """One draw per row of ``logits`` [..., V] from softmax(logits · inv_t): the argmax of
    logits * inv_t - log(-log u) with u = rng.uniform(seed, row * 64 + step, column)
    (``inv_t``: :func:`flashspec.verify.sampling.inverse_temperature`)."""
    return _reduce(logits, seed, inv_t, step)


TOPK_BLOCK = 4096


def row_topk(x: torch.Tensor, k: int, inv_t: float = 1.0, seed: torch.Tensor | None = None,
             streams: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64, log-probabilities float32) [..., k] of each row of ``x`` [..., V] under
    softmax(x · inv_t), in two kernels without a [.., V] float copy.

    Without ``seed``: the k largest entries in decreasing order (ties to the smaller column),
    ``log_softmax(x).topk(k)``. With a device ``seed`` and ``streams`` [...] (one per row): k
    draws without replacement from softmax(x · inv_t) by Gumbel top-k, the top k of
    x · inv_t - log(-log u) with u = rng.uniform(seed, stream, column), in draw order: the
    draws of :func:`flashspec.tree.pick_children`'s torch form."""
    shape, vocab = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, vocab).contiguous()
    rows, n_blocks = flat.shape[0], triton.cdiv(vocab, TOPK_BLOCK)
    kp2 = triton.next_power_of_2(k)
    dev = x.device
    vals = torch.empty(rows, n_blocks, kp2, dtype=torch.float32, device=dev)
    idx = torch.empty(rows, n_blocks, kp2, dtype=torch.int32, device=dev)
    bm = torch.empty(rows, n_blocks, dtype=torch.float32, device=dev)
    bs = torch.empty(rows, n_blocks, dtype=torch.float32, device=dev)
    tok = torch.empty(rows, k, dtype=torch.long, device=dev)
    lp = torch.empty(rows, k, dtype=torch.float32, device=dev)
    if rows:
        gumbel = seed is not None
        stream = streams.reshape(-1).contiguous() if gumbel else tok   # never read without seed
        _block_topk_kernel[(rows, n_blocks)](flat, vals, idx, bm, bs, seed if gumbel else tok,
                                             stream, vocab, n_blocks, inv_t, K=k, KP2=kp2,
                                             BLOCK=TOPK_BLOCK, GUMBEL=gumbel,
                                             INTERPRET=INTERPRET)
        nb = triton.next_power_of_2(n_blocks)
        _row_topk_kernel[(rows,)](flat, vals, idx, bm, bs, tok, lp, vocab, n_blocks, n_blocks,
                                  inv_t, K=k, KP2=kp2, NB=nb, NS=nb, FROM_KEYS=False)
    return tok.reshape(*shape, k), lp.reshape(*shape, k)


HEAD_BN = 128      # vocabulary columns per block of lowrank_topk
HEAD_SUB = 8       # blocks per program (u = h W_down^T is computed once per program)


def lowrank_topk(h: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor, k: int,
                 inv_t: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``row_topk(LowRankHead(w_down, w_up)(h), k, inv_t)`` without the [.., V] logits: for
    h [..., d], w_down [r, d], w_up [V, r] (any strides, h's dtype), (tokens int64,
    log-probabilities float32) [..., k], the k largest logits in decreasing order (ties to the
    smaller column). u = h W_down^T and the logits are rounded to h's dtype as the head's two
    matmuls write them; the sums run in another order than cuBLAS's, so a near-tie may break
    the other way (greedy drafting only: no q is kept for the verify). Two kernels: the head
    and per-block top k, then the row merge of :func:`row_topk`."""
    if w_down.dtype != h.dtype or w_up.dtype != h.dtype or w_down.shape[1] != h.shape[-1] \
            or w_up.shape[1] != w_down.shape[0]:
        raise ValueError(f"lowrank_topk: h {tuple(h.shape)} {h.dtype}, w_down "
                         f"{tuple(w_down.shape)} {w_down.dtype}, w_up {tuple(w_up.shape)} "
                         f"{w_up.dtype}: need w_down [r, d], w_up [V, r] in h's dtype")
    shape, d = h.shape[:-1], h.shape[-1]
    flat = h.reshape(-1, d).contiguous()
    rows, (vocab, rank) = flat.shape[0], w_up.shape
    n_blocks = triton.cdiv(vocab, HEAD_BN)
    n_progs = triton.cdiv(n_blocks, HEAD_SUB)
    kp2 = triton.next_power_of_2(k)
    dev = h.device
    vals = torch.empty(rows, n_blocks, kp2, dtype=torch.float32, device=dev)
    idx = torch.empty(rows, n_blocks, kp2, dtype=torch.int32, device=dev)
    bm = torch.empty(rows, n_progs, dtype=torch.float32, device=dev)
    bs = torch.empty(rows, n_progs, dtype=torch.float32, device=dev)
    tok = torch.empty(rows, k, dtype=torch.long, device=dev)
    lp = torch.empty(rows, k, dtype=torch.float32, device=dev)
    if rows:
        _lowrank_block_topk_kernel[(n_progs, triton.cdiv(rows, 16))](
            flat, w_down, w_up, vals, idx, bm, bs, rows, d, rank, vocab, n_blocks, n_progs,
            *w_down.stride(), *w_up.stride(), inv_t, K=k, KP2=kp2, BD=64,
            BR=max(16, triton.next_power_of_2(rank)), BN=HEAD_BN, SUB=HEAD_SUB,
            UPCAST=INTERPRET, IEEE=h.dtype == torch.float32)
        _row_topk_kernel[(rows,)](vals, vals, idx, bm, bs, tok, lp, vocab, n_blocks, n_progs,
                                  inv_t, K=k, KP2=kp2, NB=triton.next_power_of_2(n_blocks),
                                  NS=triton.next_power_of_2(n_progs), FROM_KEYS=True)
    return tok.reshape(*shape, k), lp.reshape(*shape, k)
