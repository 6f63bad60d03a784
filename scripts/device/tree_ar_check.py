#!/usr/bin/env python
"""On a CUDA GPU: every draft-tree node's fused attention equals, bit for bit, the AR step at
the node's position over a cache holding the prefix and then the node's path in AR's slots
(the property that makes greedy trees reproduce AR in 16-bit; see docs/trees.md).

    PYTHONPATH=$PWD python scripts/device/tree_ar_check.py      # prints mismatches per case

Shapes: SmolLM2 (9:3 heads, head dim 64), Qwen2.5-Coder-1.5B (12:2, 128) and -0.5B (14:2, 64);
bf16 and fp32 inputs, outputs kept in the input dtype and in fp32 (before rounding); random
trees of 8 to 70 nodes over prefixes below, across and past the 128-slot key blocks. The same
comparison runs on the CPU under the interpreter in tests/test_fused_layers.py."""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, "tests")
from test_fused_layers import _random_tree  # noqa: E402

from flashspec.core import TreeDraft  # noqa: E402
from flashspec.models import fused  # noqa: E402
from flashspec.tree import tree_attention  # noqa: E402


def main() -> int:
    dev, bad_cases = "cuda", 0
    for heads, kv_heads, head_dim in ((9, 3, 64), (12, 2, 128), (14, 2, 64)):
        for dtype in (torch.bfloat16, torch.float32):
            for lengths, nodes in (((5, 9), 8), ((130, 250), 17), ((300, 700), 70),
                                   ((1000, 64), 16)):
                tree = _random_tree(nodes, 2, nodes)
                tree = TreeDraft(tree.tokens.to(dev), tree.parents.to(dev), tree.depth.to(dev))
                lens, cap = torch.tensor(lengths, device=dev), 1200
                g = torch.Generator(device=dev).manual_seed(11)
                k = torch.randn(2, kv_heads, cap, head_dim, generator=g, device=dev).to(dtype)
                v = torch.randn(2, kv_heads, cap, head_dim, generator=g, device=dev).to(dtype)
                q = torch.randn(2, nodes, heads, head_dim, generator=g, device=dev).to(dtype)
                positions, att = tree_attention(tree, lens, cap)
                anc = tree.ancestors().cpu()
                res = {}
                for out_dtype in dict.fromkeys((dtype, torch.float32)):
                    got = fused.decode_attention(q, k, v, positions, tree=att, out=torch.empty(
                        q.shape, dtype=out_dtype, device=dev))
                    bad = 0
                    for b in range(2):
                        base = int(lens[b]) - 1
                        for t in range(nodes):
                            path = [base + j for j in range(nodes) if anc[b, t, j]]
                            ak, av = k[b:b + 1].clone(), v[b:b + 1].clone()
                            ak[:, :, base:base + len(path)] = k[b:b + 1, :, path]
                            av[:, :, base:base + len(path)] = v[b:b + 1, :, path]
                            pos = torch.tensor([[base + len(path) - 1]], device=dev)
                            want = fused.decode_attention(
                                q[b:b + 1, t:t + 1].contiguous(), ak, av, pos,
                                out=torch.empty(1, 1, heads, head_dim, dtype=out_dtype, device=dev))
                            bad += int(not torch.equal(got[b, t], want[0, 0]))
                    res[str(out_dtype)[6:]] = f"{bad}/{2 * nodes}"
                    bad_cases += bad > 0
                print("H", heads, "HKV", kv_heads, "hd", head_dim, str(dtype)[6:], lengths, nodes,
                      "nodes != AR:", res, flush=True)
    return int(bad_cases > 0)


if __name__ == "__main__":
    sys.exit(main())
