"""The operations that have both a torch form and a Triton form, and the one place that decides
which of the two runs a call.

Each :class:`Op` of :data:`OPS` names its torch form and its Triton form (``"module:attribute"``,
imported only by :func:`implementation`, so a CPU process that never runs a kernel never
imports triton) and holds its one applicability rule: what the Triton form cannot take (sampling
warps, dtypes, sizes, autograd, ``KernelOptions`` flags), then the device: CUDA tensors, or, for
the ops that say so (``interpreter=True``), CPU tensors when the op's kernels were built for
Triton's interpreter (read from a kernel object by :func:`flashspec.options.interpreted`, never
from the environment). :func:`choose` applies the rule and returns a :class:`Choice`: the form
to run and, when it is torch, why. Modules elsewhere ask :func:`choose` instead of testing
``is_cuda`` themselves (tests/test_kernels_registry.py greps for that).

The rules reproduce what each call site decided before the registry: the verify kernels take
CPU tensors under the interpreter, and so do the fused decode layers; the tree kernels, the
argmax / top-k kernels and the low-rank head's kernel run by default on CUDA only (tests call
them on CPU directly, or through a call's own ``fused=`` override, :func:`choose`'s ``force``).
The verify reasons are the ones the verify backend logs when it falls back (once per reason,
:func:`flashspec.verify.triton_host.log_once`); the order of the checks fixes which is logged.

This module sits with the utilities (tests/test_imports.py): it imports the core types and
the options only; the forms it names live in higher layers and are reached by name, as
:mod:`flashspec.verify.backends` reaches its backends.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from flashspec.core import SamplingParams
from flashspec.options import DEFAULT, KernelOptions, interpreted

TORCH, TRITON = "torch", "triton"

# limits of the Triton forms (their launchers import them from here)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)   # logits dtypes the verify kernels take
# CUDA's limit on programs along grid axes 1 and 2 (axis 0 takes 2^31 - 1): launches keep
# anything that grows with the batch on axis 0
MAX_GRID_Y = 65535
MAX_TOPK = 256          # chain verify: the largest top-k fused
MAX_VOCAB = 1 << 24     # verify kernels: vocabularies below this (float32-exact token ids)
DECODE_MAX_TOKENS = 4096    # query tokens per row up to which a cached step takes the fused layers
HEAD_MAX_ROWS = 16          # rows the low-rank head's skinny matmul takes
HEAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEAD_MAX_ELEMENTS = 1 << 31     # int32 offsets inside the skinny matmul

CPU_NEEDS_INTERPRETER = "CPU tensors need TRITON_INTERPRET=1 set before triton is imported"
CUDA_ONLY = "the Triton form runs on CUDA tensors only"
TURNED_OFF = "the caller chose the torch form"

Rule = Callable[..., "str | None"]


@dataclass(frozen=True)
class Op:
    """One operation: its torch and Triton forms and its rule.

    torch, triton: ``"module:attribute"`` of the two forms (same contract, same results).
    rule: ``rule(x, options, **facts) -> reason | None``: why the Triton form cannot take this
        call apart from the device (None: it can); ``facts`` are the op's other inputs.
    interpreter: CPU tensors take the Triton form when ``kernel`` was built for the interpreter
        (otherwise CPU tensors always take the torch form).
    kernel: ``"module:attribute"`` of one of the op's ``@triton.jit`` kernels, read for how the
        kernels were built; looked up only for CPU tensors of an ``interpreter`` op.
    """

    name: str
    torch: str
    triton: str
    rule: Rule
    interpreter: bool = False
    kernel: str | None = None


@dataclass(frozen=True)
class Choice:
    """The form chosen for a call and, when it is torch, why the Triton form was not."""

    impl: str
    reason: str | None = None

    @property
    def triton(self) -> bool:
        return self.impl == TRITON


_TRITON = Choice(TRITON)


# ----------------------------------------------------------------------------- rules
def logits_reason(target_logits: torch.Tensor, draft_logits: torch.Tensor | None) -> str | None:
    """Why these logits cannot go to a verify kernel (dtype, vocabulary size), or None."""
    for t in (target_logits, draft_logits):
        if t is not None and t.dtype not in DTYPES:
            return f"logits dtype {t.dtype} is not fused (bf16/fp16/fp32 are)"
    if target_logits.shape[-1] >= MAX_VOCAB:
        return "vocabularies of 2^24 or more tokens are not fused"
    return None


def _verify(x: torch.Tensor, options: KernelOptions, draft_logits: torch.Tensor | None,
            params: SamplingParams) -> str | None:
    vocab = x.shape[-1]
    if x.shape[1] > MAX_GRID_Y:
        return f"draft lengths of {MAX_GRID_Y} tokens or more are not fused"
    if params.top_p < 1.0:
        return "top-p is not fused"
    if 0 < params.top_k < vocab and params.top_k > MAX_TOPK:
        return f"top-k > {MAX_TOPK} is not fused"
    if 0 < params.top_k < vocab and x.is_cuda and not options.fuse_topk_on_cuda:
        return "fused top-k is disabled on CUDA (mismatched the reference on an H200)"
    return logits_reason(x, draft_logits)


def _tree_verify(x: torch.Tensor, options: KernelOptions, draft_logits: torch.Tensor | None,
                 params: SamplingParams) -> str | None:
    if params.top_k > 0 or params.top_p < 1.0:
        return "tree verify fuses temperature only (top-k/top-p are not fused)"
    return logits_reason(x, draft_logits)


def _always(x: torch.Tensor, options: KernelOptions) -> str | None:
    return None


def _gumbel(x: torch.Tensor, options: KernelOptions, params: SamplingParams) -> str | None:
    if params.top_k or params.top_p < 1.0:
        return "top-k/top-p draws are not fused"
    return None


def _topk(x: torch.Tensor, options: KernelOptions, params: SamplingParams,
          seed: torch.Tensor | None) -> str | None:
    if params.greedy:
        return None
    if seed is None:
        return "draws from a torch.Generator are not fused (a device seed is)"
    return _gumbel(x, options, params)


def head_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the skinny matmul cannot compute ``F.linear(x, weight)``: shapes, dtype and device
    of the pair, more than HEAD_MAX_ROWS rows, an int32-unaddressable weight, autograd (the
    kernel has no backward); None when it can."""
    if x.dim() == 0 or weight.dim() != 2 or x.shape[-1] != weight.shape[1] or x.shape[-1] == 0:
        return "shapes are not x [..., K] and weight [N, K]"
    if x.dtype != weight.dtype or x.dtype not in HEAD_DTYPES or x.device != weight.device:
        return "x and weight differ in dtype or device, or the dtype is not fused"
    if not 0 < x.numel() // x.shape[-1] <= HEAD_MAX_ROWS:
        return f"rows outside 1..{HEAD_MAX_ROWS}"
    if weight.numel() >= HEAD_MAX_ELEMENTS:
        return "weight too large for int32 offsets"
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return "autograd (the kernel has no backward)"
    return None


def _head_up(x: torch.Tensor, options: KernelOptions, weight: torch.Tensor) -> str | None:
    if not options.head_triton:
        return "KernelOptions.head_triton is off"
    return head_reason(x, weight)


def _decode_layers(x: torch.Tensor, options: KernelOptions, positions: torch.Tensor,
                   cache: Any) -> str | None:
    if cache is None:
        return "uncached step"
    if positions.shape[1] > DECODE_MAX_TOKENS:
        return f"more than {DECODE_MAX_TOKENS} query tokens per row"
    if torch.is_grad_enabled() and x.requires_grad:
        return "autograd"
    if torch.compiler.is_compiling():
        return "traced by torch.compile (which fuses the reference layers itself)"
    return None


OPS: dict[str, Op] = {op.name: op for op in (
    Op("verify", "flashspec.verify.reference:verify", "flashspec.verify.triton_backend:launch",
       _verify, interpreter=True, kernel="flashspec.verify.triton_kernels:stats_kernel"),
    Op("tree_verify", "flashspec.verify.tree:verify_tree", "flashspec.verify.triton_tree:launch",
       _tree_verify, interpreter=True, kernel="flashspec.verify.triton_tree:tree_walk_kernel"),
    Op("tree_growth", "flashspec.tree:_grow_depth", "flashspec.tree_kernels:grow_depth", _always),
    Op("tree_selection", "flashspec.tree:_keep_best", "flashspec.tree_kernels:keep_best",
       _always),
    Op("tree_compaction", "flashspec.tree:_compact", "flashspec.tree_kernels:compact", _always),
    Op("argmax", "torch:argmax", "flashspec.verify.argmax:row_argmax", _always),
    Op("gumbel_argmax", "flashspec.verify.sampling:gumbel_draw",
       "flashspec.verify.argmax:gumbel_argmax", _gumbel),
    Op("topk", "flashspec.tree:_pick_children", "flashspec.verify.argmax:row_topk", _topk),
    Op("head_up", "flashspec.matmul:linear", "flashspec.heads.triton_head:skinny_matmul",
       _head_up),
    Op("decode_layers", "flashspec.models.llama:Block", "flashspec.models.fused:run_blocks",
       _decode_layers, interpreter=True, kernel="flashspec.models.fused:_silu_mul_kernel"),
)}


# ----------------------------------------------------------------------------- choosing
def _resolve(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def implementation(name: str, impl: str) -> Any:
    """The ``impl`` (:data:`TORCH` or :data:`TRITON`) form of op ``name`` (imported here)."""
    op = OPS[name]
    return _resolve(op.torch if impl == TORCH else op.triton)


@functools.cache
def interpreter_built(name: str) -> bool:
    """Whether op ``name``'s kernels were built for Triton's interpreter (imports them)."""
    op = OPS[name]
    return op.kernel is not None and interpreted(_resolve(op.kernel))


def choose(name: str, x: torch.Tensor, options: KernelOptions = DEFAULT,
           force: bool | None = None, **facts: Any) -> Choice:
    """The form of op ``name`` for a call on ``x`` (the tensor whose device decides) with
    ``options`` and the op's other inputs ``facts``. ``force`` (a call's own ``fused=``): True
    takes the Triton form, False the torch form, whatever the rule says."""
    if force is not None:
        return _TRITON if force else Choice(TORCH, TURNED_OFF)
    op = OPS[name]
    reason = op.rule(x, options, **facts)
    if reason is None and not x.is_cuda:
        if not op.interpreter:
            reason = CUDA_ONLY
        elif not interpreter_built(name):
            reason = CPU_NEEDS_INTERPRETER
    return _TRITON if reason is None else Choice(TORCH, reason)
