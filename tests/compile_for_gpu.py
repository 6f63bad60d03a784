"""Compile every Triton kernel of flashspec for an H200 (sm_90) on a machine without a GPU.

Run as a script with TRITON_INTERPRET=0 (tests/test_triton_compiles.py does): Triton's launch
is replaced by a compile for the target, and each kernel's host wrapper is called on small CPU
tensors, so the kernels are specialised as the wrappers specialise them on a GPU (the modules
see compiled kernels and pick the compiled path's launch parameters). Nothing runs; integer
buffers are zeroed so the host code that reads them back stays in bounds. Prints one JSON object: the kernels compiled, with their variants.
"""
from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from dataclasses import replace

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run without the interpreter"

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile as triton_compile, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
COMPILED: dict[str, set] = defaultdict(set)


def compile_only(self: JITFunction, *args, grid, warmup, **kwargs):
    """JITFunction.run without a device: bind, specialise and compile for TARGET."""
    binder = create_function_from_signature(self.signature, self.params, BACKEND)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(BACKEND, kwargs, bound,
                                                            specialization, options)
    key = str(sorted(signature.items())) + str(sorted((str(k), str(v)) for k, v in constexprs.items()))
    if key not in COMPILED[self.__name__]:
        triton_compile(ASTSource(self, signature, constexprs, attrs), target=TARGET,
                       options=options.__dict__)
        COMPILED[self.__name__].add(key)
    for arg in args:       # outputs the host code reads back (indices) must be valid
        if isinstance(arg, torch.Tensor) and not arg.is_floating_point():
            arg.zero_()
    return None


JITFunction.run = compile_only


def main() -> None:
    from flashspec.verify import argmax
    from flashspec.heads.triton_head import skinny_matmul
    from flashspec.models import fused
    from flashspec.core import TreeAttention, TreeDraft, TreeShape
    from flashspec.tree import grow_tree, compact_path
    from flashspec.models.llama import KVCache, LlamaShape
    from flashspec.options import DEFAULT
    from flashspec.core import SamplingParams
    from flashspec.verify import triton_backend, triton_tree

    bf16, vocab, d = torch.bfloat16, 1000, 64
    x = torch.randn(4, 3, vocab, dtype=bf16)
    seed = torch.tensor(3)
    # argmax / top-k (greedy and Gumbel)
    argmax.row_argmax(x)
    argmax.gumbel_argmax(x, 1.0, seed, 0)
    argmax.row_topk(x, 4)
    argmax.row_topk(x, 3, 1.0, seed, torch.arange(12).reshape(4, 3))
    # the fused decode layers, chain and tree attention, bf16 and fp32
    for dtype in (bf16, torch.float32):
        h = torch.randn(2, 5, d, dtype=dtype)
        fused.add_rmsnorm(h, torch.randn_like(h), torch.ones(d, dtype=dtype), 1e-5)
        fused.add_rmsnorm(h, None, torch.ones(d, dtype=dtype), 1e-5)
        fused.silu_mul(torch.randn(2, 5, 2 * 96, dtype=dtype))
        k_cache = torch.zeros(2, 1, 64, 16, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        pos = torch.arange(5).expand(2, 5).contiguous()
        inv_freq = torch.ones(8)
        q = fused.rope_cache_write(torch.randn(2, 5, (4 + 2) * 16, dtype=dtype), pos, k_cache,
                                   v_cache, inv_freq, 1.0, 4, 1)
        fused.rope_cache_write(torch.randn(2, 5, (4 + 2) * 16, dtype=dtype), pos, k_cache,
                               v_cache, inv_freq, 1.0, 4, 1, slots=pos)
        fused.decode_attention(q, k_cache, v_cache, pos)
        parents = torch.tensor([[-1, 0, 0, 1, 1]] * 2)
        bits = TreeDraft(torch.zeros_like(parents), parents, torch.zeros_like(parents)).ancestor_bits()
        tree = TreeAttention(pos, bits, torch.tensor([3, 4]), 64)
        fused.decode_attention(q, k_cache, v_cache, pos, tree=tree)
        embed = torch.randn(vocab, d, dtype=dtype)
        src = torch.randn(2, 8, d, dtype=dtype)
        toks = torch.randint(0, vocab, (2, 5))
        norms = (torch.ones(d, dtype=dtype), torch.ones(d, dtype=dtype), 1e-5)
        fused.drafter_input(src, toks, embed, norms)
        fused.drafter_input(src, toks, embed, norms, cols=pos)
        fused.drafter_input(src, toks, embed, norms, parents=(pos, pos),
                            tree=(torch.tensor([3, 4]), 1, pos))
        skinny_matmul(torch.randn(1, d, dtype=dtype), torch.randn(256, d, dtype=dtype))
        skinny_matmul(torch.randn(4, d, dtype=dtype), torch.randn(256, d, dtype=dtype))
    # the chain verify, every plan (fused merges or not, top-k, q or one-hot), and the tree's
    drafts = torch.randint(0, vocab, (4, 2))
    target = torch.randn(4, 3, vocab, dtype=bf16)
    q = torch.randn(4, 2, vocab, dtype=bf16)
    unfinished = replace(DEFAULT, fuse_finish=False)
    for params in (SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.7, top_k=20)):
        for fuse in (True, False):
            for draft_q in (q, None):
                for options in (DEFAULT, unfinished):
                    triton_backend.launch(target, drafts, draft_q, params, seed, fused=fuse,
                                          options=options)
    for temperature in (0.0, 1.0):
        parents = torch.tensor([[-1, 0, 0, 1, 2]] * 2)
        draft = TreeDraft(torch.randint(0, vocab, (2, 5)), parents,
                          torch.tensor([[0, 1, 1, 2, 2]] * 2),
                          None if temperature == 0.0 else torch.randn(2, 5, vocab, dtype=bf16))
        triton_tree.launch(torch.randn(2, 5, vocab, dtype=bf16), draft,
                           SamplingParams(temperature), seed, None, 2)
    # tree growth bookkeeping (greedy and sampled, one and two bitmask words) and compaction
    for spec in ("3x2x1", "dyn15d6k4"):
        for temperature in (0.0, 1.0):
            grow_tree(torch.randn(2, vocab), torch.tensor([1, 2]), TreeShape.parse(spec),
                      lambda ids, *_: torch.randn(2, ids.shape[1], vocab),
                      SamplingParams(temperature), seed=None if temperature == 0.0 else seed,
                      fused=True)
    shape = LlamaShape(vocab_size=vocab, hidden_size=d, intermediate_size=96, num_layers=2,
                       num_heads=4, num_kv_heads=1, head_dim=16)
    cache = KVCache([0, 1], 2, 64, shape, bf16, "cpu")
    compact_path(cache, torch.randn(2, 5, d, dtype=bf16), torch.tensor([[1, 3], [2, -1]]),
                 torch.tensor([7, 9]), fused=True)
    print(json.dumps({name: len(v) for name, v in sorted(COMPILED.items())}))


if __name__ == "__main__":
    sys.exit(main())
