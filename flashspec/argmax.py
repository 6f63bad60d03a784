"""Row argmax and counter-based Gumbel-max draws over a wide vocabulary, in two small Triton
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
