"""Row argmax, counter-based Gumbel-max draws, and the top k (or k Gumbel top-k draws without
replacement) with their log-probabilities over a wide vocabulary, each in two small Triton
kernels (drafting on a GPU).

``torch.argmax`` of one [1, 49152] bf16 row runs as a single-block reduction, which leaves
most of a GPU idle and was the slowest kernel of a greedy EAGLE draft pass. A sampled draft was
worse: the
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
def _row_topk_kernel(x_ptr, val_ptr, idx_ptr, m_ptr, s_ptr, tok_ptr, lp_ptr, V, n_blocks, inv_t,
                     K: tl.constexpr, KP2: tl.constexpr, NB: tl.constexpr):
    """Per row: the top K keys of its blocks' candidates, with log-probabilities
    x · inv_t - lse (x read again at the K chosen columns)."""
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, NB)
    bm = tl.load(m_ptr + row * n_blocks + b, mask=b < n_blocks, other=-float("inf"))
    bs = tl.load(s_ptr + row * n_blocks + b, mask=b < n_blocks, other=0.0)
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
        _row_topk_kernel[(rows,)](flat, vals, idx, bm, bs, tok, lp, vocab, n_blocks, inv_t, K=k,
                                  KP2=kp2, NB=triton.next_power_of_2(n_blocks))
    return tok.reshape(*shape, k), lp.reshape(*shape, k)
