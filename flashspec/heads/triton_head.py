"""Triton skinny matmul for the low-rank head's up projection at small batch on CUDA.

``y = x w^T`` for x [M, K] with few rows (M <= 16) and w [N, K] with any strides (both
``out_in`` and ``in_out`` storage). Made for ``logits = u W_up^T`` with u = W_down h [M, r],
W_up [V, r]: a small K (the rank) and a huge N (the vocabulary), where cuBLAS's GEMV pays a
large fixed cost. Each program owns BLOCK_N vocabulary rows, reads its W tile once for all M
rows, accumulates in fp32 and writes y in x's dtype. One row (the decode step): a GEMV whose
K is a compile-time constant, so the k loop unrolls and a program issues all of its weight
loads before the first multiply (a head has one rank; one compile per rank). 2..16 rows:
``tl.dot`` with the rows padded to 16 (W still read once).

Imported lazily by :class:`flashspec.heads.modules.LowRankHead` (CUDA only); on CPU tensors
the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
imported; the tests).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# MAX_ROWS: the limit under the name this module's callers read
from flashspec.kernels import HEAD_MAX_ROWS as MAX_ROWS, head_reason  # noqa: F401
from flashspec.options import interpreted


@dataclass(frozen=True)
class Config:
    """Tile sizes and launch parameters of one kernel instance."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2


def default_config(rows: int, k: int) -> Config:
    """One row: 64-wide k chunks (a rank is a multiple of 16, so little is masked), 32 rows per
    program and 8 warps (the most programs in flight per SM, each issuing few loads: the best or
    within a few per cent of the best tile of scripts/device/head_tune.py at ranks 96 to 192,
    V = 151,936, on an H100); more rows: 64 x 128 tiles for ``tl.dot``."""
    if rows == 1:
        return Config(32, max(16, min(triton.next_power_of_2(k), 64)), 8, 1)
    return Config(64, max(16, min(triton.next_power_of_2(k), 128)), 4, 3)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``skinny_matmul(x, weight)`` applies: same dtype and device, 1..16 rows, no
    autograd (the kernel has no backward), int32-addressable weight (the ``head_up`` rule's
    limits, :func:`flashspec.kernels.head_reason`)."""
    return head_reason(x, weight) is None


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, sxk, swn, swk, syn,
                 K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[n] = sum_k x[k] w[n, k] for BLOCK_N rows n: one row of x, K known at compile time."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_in = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None] * swn + offs_k[None, :] * swk,
                    mask=n_in[:, None] & k_in[None, :], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptr + offs_k * sxk, mask=k_in, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + offs_n * syn, acc.to(y_ptr.dtype.element_ty), mask=n_in)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sxm, sxk, swn, swk, sym, syn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """y[m, n] = sum_k x[m, k] w[n, k] for BLOCK_N columns n and all (<= BLOCK_M = 16) rows m."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_in = offs_m < M
    n_in = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_in = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None] * swn + offs_k[None, :] * swk,
                    mask=n_in[:, None] & k_in[None, :], other=0.0)
        x = tl.load(x_ptr + offs_m[:, None] * sxm + offs_k[None, :] * sxk,
                    mask=m_in[:, None] & k_in[None, :], other=0.0)
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    tl.store(y_ptr + offs_m[:, None] * sym + offs_n[None, :] * syn,
             acc.to(y_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


# the interpreter's tl.dot mishandles bf16 (numpy has none): it multiplies in fp32 instead
INTERPRET = interpreted(_skinny_kernel)


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, config: Config | None = None
                  ) -> torch.Tensor:
    """``F.linear(x, weight)`` for x [..., K] with 1..16 rows and weight [N, K]; fp32
    accumulation, output in x's dtype. Raises ValueError where :func:`supports` is False."""
    if not supports(x, weight):
        raise ValueError(f"skinny_matmul: unsupported x {tuple(x.shape)} {x.dtype} {x.device}, "
                         f"weight {tuple(weight.shape)} {weight.dtype} {weight.device}")
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    cfg = config or default_config(rows, k)
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 1:
        _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
            x2, weight, y, n, x2.stride(1), *weight.stride(), y.stride(1),
            K=k, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return y.reshape(*x.shape[:-1], n)
    if min(cfg.block_n, cfg.block_k) < 16:
        raise ValueError(f"tl.dot tiles need block_n, block_k >= 16; got {cfg}")
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32: ignored for 16-bit inputs
    _skinny_kernel[(triton.cdiv(n, cfg.block_n),)](
        x2, weight, y, rows, n, k, *x2.stride(), *weight.stride(), *y.stride(),
        BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION=precision,
        UPCAST=INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.reshape(*x.shape[:-1], n)
