"""Kernel options: every switch of the Triton kernels, passed in explicitly.

One frozen :class:`KernelOptions` travels from ``conf/runtime/<mode>.yaml`` (its ``kernels:``
mapping, ``_target_: flashspec.options.KernelOptions``) to the verify backend
(:func:`flashspec.verify.get_backend`) and the heads (``LowRankHead(use_triton=...)``). No
module global or environment variable changes what a kernel does; a benchmark that compares
two settings builds two option objects (``dataclasses.replace(options, fuse_finish=False)``).
The defaults are the behaviour of every runtime config.

Triton's interpreter is the one exception to "explicit": it is Triton's own process-wide mode,
chosen by ``TRITON_INTERPRET=1`` in the environment *before* triton is imported (the tests set
it in conftest.py), and it decides how ``@triton.jit`` builds each kernel object. FlashSpec
never reads that variable: :func:`interpreted` asks a kernel object how it was built. CPU
tensors can run the kernels only when it is true (the verify backend then falls back to the
reference, with a logged reason, and the fused layers and head kernel keep their torch paths).
Which form runs a call, from these options, the tensors and that mode, is decided in one place,
:func:`flashspec.kernels.choose`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelOptions:
    """Switches of the Triton verify kernels and the low-rank head kernel.

    fuse_topk_on_cuda: run top-k warps (k <= 256) through the fused verify on CUDA. Off: on
        the GPU the fused top-k path disagreed with the reference on some rows (an H200 check:
        gpu_checks/verify_topk on branch lab-notebook), so top-k on CUDA falls back to the
        reference (exact by definition).
        The interpreter (CPU) always fuses top-k.
    fuse_merges: merge the per-chunk statistics in the last program of each row group (atomic
        counters) instead of a separate decide kernel; None lets the launch plan choose
        (fused up to ``triton_backend.FUSE_MAX_BATCH`` rows on the GPU, always in the
        interpreter). A call's own ``fused=`` argument wins over this.
    fuse_finish: the race's last program per row group picks the winners at every batch size
        (a separate finish kernel only when False and the merges are not fused).
    direct_launch: launch the cached compiled verify kernels directly
        (``CompiledKernel[grid](...)``), skipping Triton's argument binder after the first call
        of a shape; CUDA only (ignored by the interpreter). Opt-in: it relies on Triton's
        launcher convention (all parameters, constexprs included, in signature order).
    head_triton: the low-rank head's up projection runs the Triton skinny matmul on CUDA
        (<= 16 rows, no autograd). Off by default: turn it on where experiment=head_bench
        times it below cuBLAS at the drafter's shape (docs/heads.md).
    """

    fuse_topk_on_cuda: bool = False
    fuse_merges: bool | None = None
    fuse_finish: bool = True
    direct_launch: bool = False
    head_triton: bool = False


DEFAULT = KernelOptions()


def interpreted(kernel: object) -> bool:
    """Whether ``kernel`` (a ``@triton.jit`` function) was built for Triton's interpreter, i.e.
    TRITON_INTERPRET=1 was set before triton was imported. The one place FlashSpec decides
    the interpreter mode; it reads the kernel object, never the environment."""
    return type(kernel).__name__ == "InterpretedFunction"
