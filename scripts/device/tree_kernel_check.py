#!/usr/bin/env python
"""GPU check of the tree drafting kernels against their torch forms, and the per-call time of
the decode attention for chain and tree queries; one JSON line per case.

- ``grow``: :func:`flashspec.tree.grow_tree` with the Triton bookkeeping (``fused=True``)
  against the torch bookkeeping on the same GPU logits (the children come from the same
  ``pick_children`` either way): rows whose tokens, parents, depths or ancestor bits differ.
- ``gumbel_topk``: :func:`flashspec.verify.argmax.row_topk` with a seed on the GPU against
  ``pick_children``'s torch form on the CPU copy of the logits: rows whose children differ.
- ``drafter_input``: :func:`flashspec.models.fused.drafter_input` (SmolLM2 sizes, bf16 and
  fp32, each way of picking the feature rows) against the gathers, embedding, ``add_rmsnorm``
  and concatenation it replaces: elements that differ (bit for bit).
- ``tree_verify``: :func:`flashspec.verify.triton_tree.launch` with each node's statistics in
  1 and in STAT_SPLITS programs (the residual masses and the race split over programs either
  way) against the reference rule (greedy and T = 1 with sampled
  siblings, 16 nodes, V 49152, bf16): rows whose tokens, counts or paths differ.
- ``compact``: :func:`flashspec.tree.compact_path` in one launch against the torch gathers and
  scatters at SmolLM2's cache shape (bf16): elements of K, V and the hidden rows that differ.
- ``*_us`` (``--timing``): graph-replayed µs per call of the tree verify (1 / STAT_SPLITS
  programs per node), the compaction (fused / torch) and a dyn15d6k4 growth's bookkeeping
  (fused / torch, the drafter stand-in included).
- ``attention_us`` (``--attention``): one ``decode_attention`` call, graph-replayed, for the
  queries of an AR step (1 token), a chain verify (5), a drafter window (7), a drafter
  frontier (4 tree nodes) and a tree verify (16 nodes), at the same context lengths, over
  launch geometries (query rows, key slots, warps per program).

    python scripts/device/tree_kernel_check.py [--out check.jsonl] [--device cpu] [--timing]
        [--attention]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from flashspec.core import SamplingParams, TreeShape
from flashspec.verify.argmax import row_topk
from flashspec.tree import grow_tree, pick_children
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


def graph_us(call) -> float:
    """µs per call of ``call``: 50 calls captured in a CUDA graph, replayed 10 times."""
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
    return round(start.elapsed_time(end) * 1e3 / 500, 2)


PARENTS16 = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 5, 7, 7, 8, 10, 11, 13]
DEPTH16 = [0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 6]


def verify_case(batch: int, temperature: float, dev: str, seed: int):
    """A 16-node tree per row whose drafts often match the target's argmax (so walks go deep)."""
    from flashspec.core import TreeDraft
    gen = torch.Generator(device=dev).manual_seed(seed)
    target = (3 * torch.randn(batch, 16, VOCAB, device=dev, generator=gen)).to(torch.bfloat16)
    parents = torch.tensor([PARENTS16] * batch, device=dev)
    depth = torch.tensor([DEPTH16] * batch, device=dev)
    best = target.float().argmax(-1)
    noise = torch.randint(0, VOCAB, (batch, 16), device=dev, generator=gen)
    keep = torch.rand(batch, 16, device=dev, generator=gen) < 0.7
    tokens = torch.where(keep, best.gather(1, parents.clamp(min=0)), noise)
    q = None if temperature == 0.0 else (target.float() + torch.randn(
        target.shape, device=dev, generator=gen)).to(torch.bfloat16)
    return target, TreeDraft(tokens, parents, depth, q, fanout=3)


def check_tree_verify(out, dev: str) -> None:
    from flashspec.verify import tree as reference_tree, triton_tree
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature)
        for splits in (1, triton_tree.STAT_SPLITS):
            bad = rows = deep = 0
            for trial in range(8):
                batch = 1 if trial % 2 else 4
                target, draft = verify_case(batch, temperature, dev, trial)
                want = reference_tree.verify_tree(target.float(), draft, params, 50 + trial,
                                                  None, 6)
                got = triton_tree.launch(target, draft, params, 50 + trial, None, 6, splits)
                diff = torch.zeros(batch, dtype=torch.bool, device=dev)
                for w, g in zip(want, got):
                    diff |= (w != g).reshape(batch, -1).any(1)
                bad += int(diff.sum())
                rows += batch
                deep += int((got[1] >= 2).sum())
            emit(out, check="tree_verify", temperature=temperature, splits=splits, rows=rows,
                 rows_accepting_2_plus=deep, mismatched_rows=bad)


def compact_case(dev: str, batch: int = 4):
    from flashspec.models.llama import KVCache, LlamaShape
    shape = LlamaShape(vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_layers=30,
                       num_heads=9, num_kv_heads=3, head_dim=64)
    gen = torch.Generator(device=dev).manual_seed(9)
    cache = KVCache(list(range(30)), batch, 2048, shape, torch.bfloat16, dev)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    hidden = torch.randn(batch, 16, 576, device=dev, generator=gen).to(torch.bfloat16)
    path = torch.tensor([[2, 5, 9, 12, 14, 15], [3, 6, -1, -1, -1, -1], [-1] * 6,
                         [1, 4, 7, 10, 13, -1]][:batch], device=dev)
    lengths = torch.tensor([700, 1500, 33, 2000][:batch], device=dev)
    return cache, hidden, path, lengths


def check_compact(out, dev: str) -> None:
    from flashspec.tree import compact_path
    results = []
    for fused in (False, True):
        cache, hidden, path, lengths = compact_case(dev)
        results.append((compact_path(cache, hidden, path, lengths, fused=fused), cache.k, cache.v))
    emit(out, check="compact", **{name: int((a != b).sum()) for name, a, b in
                                  zip(("hidden", "k", "v"), *results)})


def time_tree_kernels(out) -> None:
    from flashspec.tree import compact_path
    from flashspec.verify import triton_tree
    dev = "cuda"
    for temperature in (0.0, 1.0):
        target, draft = verify_case(1, temperature, dev, 0)
        params, seed = SamplingParams(temperature), torch.tensor(3, device=dev)
        for splits in (1, triton_tree.STAT_SPLITS):
            emit(out, check="tree_verify_us", temperature=temperature, splits=splits,
                 us=graph_us(lambda: triton_tree.launch(target, draft, params, seed, None, 6,
                                                        splits)))
    cache, hidden, path, lengths = compact_case(dev, 1)
    for fused in (False, True):
        emit(out, check="compact_us", fused=fused,
             us=graph_us(lambda: compact_path(cache, hidden, path, lengths, fused=fused)))
    root = (4 * torch.randn(1, VOCAB, device=dev)).to(torch.bfloat16)
    root_tok = torch.zeros(1, dtype=torch.long, device=dev)
    logits = (4 * torch.randn(1, 4, VOCAB, device=dev)).to(torch.bfloat16)
    for fused in (False, True):   # the drafter stand-in returns fixed logits: bookkeeping only
        emit(out, check="grow_us", shape="dyn15d6k4", fused=fused, us=graph_us(
            lambda: grow_tree(root, root_tok, TreeShape.parse("dyn15d6k4"),
                              lambda ids, *_: logits[:, :ids.shape[1]], SamplingParams(0.0),
                              fused=fused)))


def time_attention(out) -> None:
    """Per-call µs of decode_attention (SmolLM2: 9 heads, 3 kv heads, head dim 64, bf16)."""
    from flashspec.models import fused
    from flashspec.core import TreeAttention, TreeDraft, TreeShape
    dev, heads, kv, hd, cap = "cuda", 9, 3, 64, 2048
    k = torch.randn(1, kv, cap, hd, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    parents = torch.tensor([PARENTS16], device=dev)
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
                emit(out, check="attention_us", case=name, context=ctx, block_m=block_m,
                     block_n=block_n, warps=warps, us=graph_us(call))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run (TRITON_INTERPRET=1)")
    ap.add_argument("--timing", action="store_true",
                    help="also time the tree verify, compaction and growth kernels (GPU)")
    ap.add_argument("--attention", action="store_true", help="also time decode_attention (GPU)")
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
    check_tree_verify(out, dev)
    check_compact(out, dev)
    if args.timing:
        time_tree_kernels(out)
    if args.attention:
        time_attention(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
