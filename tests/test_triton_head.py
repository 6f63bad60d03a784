"""Triton up projection of the low-rank head vs F.linear: CPU under TRITON_INTERPRET=1.

On a GPU machine, ``TRITON_INTERPRET=0 pytest tests/test_triton_head.py`` runs the same
comparisons with compiled kernels on CUDA tensors, plus real head shapes and the
LowRankHead dispatch.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported anywhere

import pytest
import torch
import torch.nn.functional as F

from flashspec.heads import triton_head as th
from flashspec.heads.modules import LowRankHead

CUDA = not th.INTERPRET and torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="compiled kernel on CUDA (TRITON_INTERPRET=0)")


def make(rows: int, n: int, k: int, dtype: torch.dtype, layout: str = "out_in", seed: int = 0
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] and w [n, k] (``in_out``: w is the transpose of a contiguous [k, n])."""
    g = torch.Generator(DEVICE).manual_seed(seed)
    x = torch.randn(rows, k, generator=g, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, generator=g, device=DEVICE) / k ** 0.5).to(dtype)
    return x, (w.T.contiguous().T if layout == "in_out" else w)


def assert_matches(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y == x w^T up to the output dtype's rounding (reference: fp32 on the same inputs)."""
    ref = F.linear(x.float(), w.float())
    assert y.dtype == x.dtype and y.shape == ref.shape
    tol = {torch.float32: (1e-5, 1e-5)}.get(x.dtype, (2e-2, 2e-2))  # 16-bit: ~1 ulp + sum order
    torch.testing.assert_close(y.float(), ref, rtol=tol[0], atol=tol[1])


def test_runs_in_interpreter_or_on_cuda():
    """Guard: under a compiled triton on CPU every call would fail, not silently pass."""
    assert th.INTERPRET or CUDA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(1001, 37), (517, 72)])   # V and r not multiples of any tile
@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_matches_f_linear(dtype, rows, n, k, layout):
    x, w = make(rows, n, k, dtype, layout)
    assert_matches(th.skinny_matmul(x, w), x, w)


@pytest.mark.parametrize("rows", [1, 5])
def test_several_k_tiles_and_partial_last_blocks(rows):
    """block_k < r: the rank loop runs 3 tiles, the last one masked; block_n cuts V unevenly."""
    x, w = make(rows, 301, 37, torch.float32, seed=rows)
    cfg = th.Config(block_n=32, block_k=16)
    assert_matches(th.skinny_matmul(x, w, cfg), x, w)


def test_leading_dims_and_strided_input_are_kept():
    x, w = make(6, 257, 40, torch.float32)
    x3 = x.reshape(2, 3, 40)
    y = th.skinny_matmul(x3, w)
    assert y.shape == (2, 3, 257)
    assert_matches(y.reshape(6, 257), x, w)
    wide = torch.randn(3, 80, device=DEVICE)[:, ::2]      # non-contiguous rows (stride 2)
    assert_matches(th.skinny_matmul(wide, w), wide, w)
    assert_matches(th.skinny_matmul(wide[1:2], w), wide[1:2], w)        # one row: the GEMV path


def test_a_wrong_result_is_caught():
    """The comparison is tight enough to fail on a one-ulp-scale bug: a dropped last column
    (a masking error), rows swapped, or one weight row off by a little."""
    x, w = make(3, 1001, 37, torch.bfloat16)
    y = th.skinny_matmul(x, w)
    assert_matches(y, x, w)
    dropped = y.clone()
    dropped[:, -1] = 0
    w_off = w.clone()
    w_off[500] += 0.1
    for bad in (dropped, y.flip(0), th.skinny_matmul(x, w_off)):
        with pytest.raises(AssertionError):
            assert_matches(bad, x, w)


def test_supports_rejects_what_the_kernel_cannot_do():
    x, w = make(16, 50, 8, torch.float32)
    assert th.supports(x, w) and th.supports(x[:1], w)
    assert not th.supports(torch.cat([x, x[:1]]), w)                    # 17 rows
    assert not th.supports(x.bfloat16(), w)                              # dtype mismatch
    assert not th.supports(x.long(), w.long())                           # not a float dtype
    assert not th.supports(x[:, :4], w)                                  # K mismatch
    wg = w.clone().requires_grad_(True)
    assert not th.supports(x, wg)                                        # autograd needs F.linear
    with torch.no_grad():
        assert th.supports(x, wg)
    with pytest.raises(ValueError):
        th.skinny_matmul(torch.cat([x, x[:1]]), w)


def test_default_config_tiles():
    one = th.default_config(1, 192)                                      # Qwen's d/8 rank
    assert one.block_k == 64 and 192 % one.block_k == 0 and one.block_n >= 16
    assert th.default_config(1, 24).block_k == 32 and th.default_config(1, 4096).block_k == 64
    dot = th.default_config(16, 37)
    assert dot.block_k == 64 and dot.block_n >= 16


def test_bench_times_triton_variant_only_on_cuda_and_small_batch():
    from flashspec.analysis.head_bench import BenchConfig, _variants
    cpu, gpu = BenchConfig(device="cpu"), BenchConfig(device="cuda")
    assert not cpu.triton_at(1) and gpu.triton_at(1) and gpu.triton_at(16)
    assert not gpu.triton_at(17) and not BenchConfig(device="cuda", triton=False).triton_at(1)
    cfg = BenchConfig(rank_divs=[8], truncated_kept=False, max_copies=1)
    vs = _variants(48, 300, cfg, torch.float32, 0, torch.Generator().manual_seed(0), triton=True)
    assert [v.name for v in vs] == ["full", "lowrank_d/8", "lowrank_triton_d/8", "truncated_d/8"]
    assert [v.copies[0].use_triton for v in vs[1:3]] == [False, True]


def test_lowrank_head_on_cpu_keeps_f_linear(monkeypatch):
    """CPU tensors never reach the kernel (it would need the interpreter)."""
    monkeypatch.setattr(th, "skinny_matmul", lambda *a, **k: pytest.fail("kernel called"))
    head = LowRankHead(torch.randn(6, 48), torch.randn(300, 6), use_triton=True)
    h = torch.randn(2, 48)
    with torch.inference_mode():
        torch.testing.assert_close(head.cpu()(h), h @ head.w_down.T @ head.w_up.T)


@needs_cuda
@pytest.mark.parametrize("rows", [1, 3, 16, 17])
def test_lowrank_head_dispatch_on_cuda(monkeypatch, rows):
    calls = []
    kernel = th.skinny_matmul
    monkeypatch.setattr(th, "skinny_matmul", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    x, w_up = make(rows, 5003, 72, torch.bfloat16)
    head = LowRankHead(torch.randn(72, 200).to(DEVICE, torch.bfloat16), w_up, use_triton=True)
    h = torch.randn(rows, 200, device=DEVICE, dtype=torch.bfloat16)
    with torch.inference_mode():
        y = head(h)
        head.use_triton = False
        ref = head(h)
    assert len(calls) == (rows <= th.MAX_ROWS)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)
    head.use_triton = True
    h.requires_grad_(True)
    head(h).sum().backward()                      # training: F.linear, gradients flow
    assert head.w_up.grad is not None and len(calls) == (rows <= th.MAX_ROWS)


BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@needs_cuda
@pytest.mark.parametrize("n,k,dtype,layout", [
    (128256, 512, BF16, "out_in"), (128256, 512, BF16, "in_out"), (128256, 128, BF16, "out_in"),
    (49152, 72, BF16, "out_in"), (152064, 448, BF16, "out_in"), (128256, 512, F16, "out_in"),
    (128256, 512, F32, "out_in"), (49152, 72, F32, "in_out")])
def test_real_head_shapes_on_cuda(n, k, dtype, layout):
    """Llama-3.1-8B at d/8 and d/32, SmolLM2 at d/8, Qwen2.5-7B at d/8; 1, 3 and 16 rows."""
    for rows in (1, 3, 16):
        x, w = make(rows, n, k, dtype, layout, seed=rows)
        assert_matches(th.skinny_matmul(x, w), x, w)
