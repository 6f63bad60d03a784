#!/usr/bin/env python
"""GPU check of the tree drafting kernels against their torch forms; one JSON line per case.

- ``grow``: :func:`flashspec.tree.grow_tree` with the Triton bookkeeping (``fused=True``)
  against the torch bookkeeping on the same GPU logits (the children come from the same
  ``pick_children`` either way): rows whose tokens, parents, depths or ancestor bits differ.
- ``gumbel_topk``: :func:`flashspec.argmax.row_topk` with a seed on the GPU against
  ``pick_children``'s torch form on the CPU copy of the logits: rows whose children differ.

    python scripts/device/tree_kernel_check.py [--out check.jsonl] [--device cpu]
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run (TRITON_INTERPRET=1)")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
