"""Row argmax over a wide vocabulary in two small Triton kernels (greedy drafting on a GPU).

``torch.argmax`` of one [1, 49152] bf16 row runs as a single-block reduction: about 13 µs on
an H200, the slowest kernel of an EAGLE draft pass. Here every program reduces one block of
``BLOCK`` columns of a row to its (max, first index of the max), and a second kernel reduces a
row's blocks. Ties go to the smallest index, as with ``torch.argmax``; the result is clamped
into [0, V), so a NaN row cannot yield an out-of-range token id.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashspec.options import interpreted

BLOCK = 1024


@triton.jit
def _block_max_kernel(x_ptr, val_ptr, idx_ptr, V, n_blocks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * V + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
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


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` (int64, first index of the max) of ``x`` [..., V] on CUDA (or on a CPU
    under Triton's interpreter); other CPU tensors take ``torch.argmax``."""
    if not (x.is_cuda or interpreted(_block_max_kernel)):
        return x.argmax(dim=-1)
    shape, vocab = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, vocab).contiguous()
    rows, n_blocks = flat.shape[0], triton.cdiv(vocab, BLOCK)
    vals = torch.empty(rows, n_blocks, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, n_blocks, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.long, device=x.device)
    if rows:
        _block_max_kernel[(rows, n_blocks)](flat, vals, idx, vocab, n_blocks, BLOCK=BLOCK)
        _row_max_kernel[(rows,)](vals, idx, out, vocab, n_blocks,
                                 NB=triton.next_power_of_2(n_blocks))
    return out.reshape(shape)
