#!/usr/bin/env python
"""GPU check of the tree drafting kernels against their torch forms, and the per-call time of
the decode attention for chain and tree queries; one JSON line per case.

- ``grow``: :func:`flashspec.tree.grow_tree` with the Triton bookkeeping (``fused=True``)
  against the torch bookkeeping on the same GPU logits (the children come from the same
  ``pick_children`` either way): rows whose tokens, parents, depths or ancestor bits differ.
- ``gumbel_topk``: :func:`flashspec.argmax.row_topk` with a seed on the GPU against
  ``pick_children``'s torch form on the CPU copy of the logits: rows whose children differ.
- ``drafter_input``: :func:`flashspec.models.fused.drafter_input` (SmolLM2 sizes, bf16 and
  fp32, each way of picking the feature rows) against the gathers, embedding, ``add_rmsnorm``
  and concatenation it replaces: elements that differ (bit for bit).
- ``attention_us`` (``--timing``): one ``decode_attention`` call, graph-replayed, for the
  queries of an AR step (1 token), a chain verify (5), a drafter window (7), a drafter
  frontier (4 tree nodes) and a tree verify (16 nodes), at the same context lengths, over
  launch geometries (query rows, key slots, warps per program).

    python scripts/device/tree_kernel_check.py [--out check.jsonl] [--device cpu] [--timing]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from flashspec.argmax import row_topk
from flashspec.tree import TreeShape, grow_tree, pick_children
from flashspec.verify import SamplingParams
from flashspec.verify.sampling import inverse_temperature

VOCAB = 49152


def emit(out, **row) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")


def expand_on(vocab: int, dev: str):
    """A drafter stand-in: logits of scale 4 that depend on the node's token and depth."""
    def expand(ids, toks, parents, depth, bits):
        gen = torch.Generator(device=dev).manual_seed(depth)
        base = 4 * torch.randn(ids.shape[0], 1, vocab, device=dev, generator=gen)
        return (base + (toks[..., None] % 97).float() / 50).to(torch.bfloat16)
    return expand


def check_drafter_input(out, dev: str) -> None:
    import torch.nn.functional as F
    from flashspec.models import fused
    d, vocab, batch, n, p = 576, VOCAB, 4, 7, 16
    for dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator(device=dev).manual_seed(5)
        src = torch.randn(batch, 3 * p, d, device=dev, generator=gen).to(dtype)[:, ::3]
        embed = torch.randn(vocab, d, device=dev, generator=gen).to(dtype)
        w = (1 + 0.2 * torch.randn(2, d, device=dev, generator=gen)).to(dtype)
        tokens = torch.randint(0, vocab, (batch, n), device=dev, generator=gen)
        cols = torch.randint(0, p, (batch, n), device=dev, generator=gen)
        fed = torch.stack([torch.randperm(100, device=dev, generator=gen)[:p] for _ in range(batch)])
        for mode, kw in (("cols", dict(cols=cols)), ("parents", dict(parents=(fed, fed.gather(1, cols))))):
            feats = src.gather(1, cols[..., None].expand(-1, -1, d))
            emb = F.embedding(tokens, embed)
            want = torch.cat([fused.add_rmsnorm(feats, None, w[0], 1e-5)[1],
                              fused.add_rmsnorm(emb, None, w[1], 1e-5)[1]], -1)
            got = fused.drafter_input(src, tokens, embed, (w[0], w[1], 1e-5), **kw)
            emit(out, check="drafter_input", dtype=str(dtype).removeprefix("torch."), mode=mode,
                 elements=want.numel(), mismatched=int((got != want).sum()))


def time_attention(out) -> None:
    """Per-call µs of decode_attention (SmolLM2: 9 heads, 3 kv heads, head dim 64, bf16)."""
    from flashspec.models import fused
    from flashspec.tree import TreeAttention, TreeDraft, TreeShape
    dev, heads, kv, hd, cap = "cuda", 9, 3, 64, 2048
    k = torch.randn(1, kv, cap, hd, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    parents = torch.tensor([[-1, 0, 0, 0, 1, 1, 2, 4, 4, 5, 7, 7, 8, 10, 11, 13]], device=dev)
    tree16 = TreeDraft(torch.zeros_like(parents), parents, torch.zeros_like(parents))
    bits16 = tree16.ancestor_bits()
    for ctx in (256, 512, 1024):
        lengths = torch.tensor([ctx], device=dev)
        cases = {"ar_1": (1, None), "chain_5": (5, None), "window_7": (7, None),
                 "frontier_4": (4, "tree"), "verify_16": (16, "tree")}
        for name, (n, kind) in cases.items():
            q = torch.randn(1, n, heads, hd, device=dev, dtype=torch.bfloat16)
            pos = (ctx - n + torch.arange(n, device=dev))[None]
            tree = None
            if kind:
                bits = bits16[:, :n] if n == 16 else bits16[:, 12:12 + n]
                tree = TreeAttention(ctx - 1 + torch.arange(n, device=dev)[None] + (16 - n),
                                     bits, lengths, cap)
            for block_m, block_n, warps in ((None, None, 4), (16, 32, 4), (16, 128, 4),
                                            (16, 64, 2), (32, 64, 4)):
                call = lambda: fused.decode_attention(q, k, v, pos, block_m, tree, block_n, warps)
                for _ in range(3):
                    call()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(50):
                        call()
                graph.replay()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(10):
                    graph.replay()
                end.record()
                torch.cuda.synchronize()
                emit(out, check="attention_us", case=name, context=ctx, block_m=block_m,
                     block_n=block_n, warps=warps, us=round(start.elapsed_time(end) * 1e3 / 500, 2))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run (TRITON_INTERPRET=1)")
    ap.add_argument("--timing", action="store_true", help="also time decode_attention (GPU)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("tree_kernel_check needs a CUDA GPU", file=sys.stderr)
        return 2
    out = open(args.out, "a") if args.out else None
    dev = args.device
    for spec in ("3x2x1", "dyn10d5k2", "dyn15d6k4", "dyn15d8k3"):
        for temperature in (0.0, 1.0):
            bad = rows = 0
            for trial in range(10):
                batch = 1 if trial % 2 else 4
                gen = torch.Generator(device=dev).manual_seed(trial)
                root = (4 * torch.randn(batch, VOCAB, device=dev, generator=gen)).to(torch.bfloat16)
                params = SamplingParams(temperature)
                seed = None if params.greedy else torch.tensor(100 + trial, device=dev)
                trees = [grow_tree(root, torch.arange(batch, device=dev), TreeShape.parse(spec),
                                   expand_on(VOCAB, dev), params, seed=seed, fused=fused)
                         for fused in (False, True)]
                diff = torch.zeros(batch, dtype=torch.bool, device=dev)
                for name in ("tokens", "parents", "depth"):
                    diff |= (getattr(trees[0], name) != getattr(trees[1], name)).any(1)
                diff |= (trees[0].bits != trees[1].bits).flatten(1).any(1)
                bad += int(diff.sum())
                rows += batch
            emit(out, check="grow", shape=spec, temperature=temperature, rows=rows,
                 mismatched_rows=bad)
    for k, temperature in ((2, 1.0), (4, 1.0), (3, 0.6)):
        gen = torch.Generator(device=dev).manual_seed(k)
        x = (4 * torch.randn(64, VOCAB, device=dev, generator=gen)).to(torch.bfloat16)
        seed = torch.tensor(7 + k, device=dev)
        streams = torch.arange(64, device=dev) * 1024 + 3
        tok, lp = row_topk(x, k, inverse_temperature(temperature), seed, streams)
        want, want_lp = pick_children(x.cpu(), k, SamplingParams(temperature), None, seed.cpu(),
                                      streams.cpu())
        emit(out, check="gumbel_topk", k=k, temperature=temperature, rows=64,
             mismatched_rows=int((tok.cpu() != want).any(1).sum()),
             max_lp_err=float((lp.cpu() - want_lp).abs().max()))
    check_drafter_input(out, dev)
    if args.timing:
        time_attention(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
