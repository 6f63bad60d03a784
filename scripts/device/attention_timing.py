#!/usr/bin/env python
"""On a CUDA GPU: time one fused attention call (CUDA-graph replays of 200 calls) for a
16-node draft tree, target-only AR and a 5-token chain, at SmolLM2 and Qwen2.5-Coder-1.5B
head shapes and several cached lengths; with ``--baseline FILE`` (another version of
flashspec/models/fused.py, e.g. ``git show REV:flashspec/models/fused.py > old.py``) its tree
attention too, with key blocks of 64 and 128.

    PYTHONPATH=$PWD python scripts/device/attention_timing.py [--baseline old_fused.py]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys

import torch

sys.path.insert(0, "tests")
from test_fused_layers import _random_tree  # noqa: E402

from flashspec.core import TreeDraft  # noqa: E402
from flashspec.models import fused  # noqa: E402
from flashspec.tree import tree_attention  # noqa: E402


def timed(fn, reps: int = 200) -> float:
    """Microseconds per call, from one CUDA-graph replay of ``reps`` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", help="another fused.py to time beside this one")
    a = ap.parse_args()
    old = None
    if a.baseline:
        spec = importlib.util.spec_from_file_location("baseline_fused", a.baseline)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    dev, dtype, nodes = "cuda", torch.bfloat16, 16
    for heads, kv_heads, head_dim in ((9, 3, 64), (12, 2, 128)):
        for cached in (150, 280, 600):
            tree = _random_tree(nodes, 1, nodes)
            tree = TreeDraft(tree.tokens.to(dev), tree.parents.to(dev), tree.depth.to(dev))
            k = torch.randn(1, kv_heads, 2048, head_dim, device=dev, dtype=dtype)
            v = torch.randn_like(k)
            q = torch.randn(1, nodes, heads, head_dim, device=dev, dtype=dtype)
            positions, att = tree_attention(tree, torch.tensor([cached], device=dev), 2048)
            q1, p1 = q[:, :1].contiguous(), torch.tensor([[cached - 1]], device=dev)
            q5 = q[:, :5].contiguous()
            p5 = (cached - 1 + torch.arange(5, device=dev))[None]
            r = dict(new_tree=timed(lambda: fused.decode_attention(q, k, v, positions, tree=att)))
            if old is not None:
                r["old_tree"] = timed(lambda: old.decode_attention(q, k, v, positions, tree=att))
                r["old_tree_bn128"] = timed(lambda: old.decode_attention(
                    q, k, v, positions, tree=att, block_n=128))
            r["new_tree_bn64"] = timed(lambda: fused.decode_attention(
                q, k, v, positions, tree=att, block_n=64))
            r["ar"] = timed(lambda: fused.decode_attention(q1, k, v, p1))
            r["chain5"] = timed(lambda: fused.decode_attention(q5, k, v, p5))
            print(heads, kv_heads, head_dim, "L", cached, {n: round(t, 2) for n, t in r.items()},
                  "us/call", flush=True)


if __name__ == "__main__":
    main()
