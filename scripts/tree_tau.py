#!/usr/bin/env python
"""τ of the trained EAGLE drafter (or n-gram lookup, ``--drafter ngram``) as a draft tree vs as
a chain at the same verify width.

Greedy and T = 1 on HumanEval and MT-Bench (first turns), prompts drawn with ``--seed`` from the
eval split; τ is tokens per target forward. Greedy outputs are checked equal to target-only AR.
On a GPU every engine uses CUDA graphs for what it can (the tree step itself runs eagerly) and
the fused verify; each engine is warmed up (graph capture, then every prompt's prefill: kernels
specialise on prompt-length buckets, and the first method to meet one would pay the compile in
its timed call), then tok/s (new tokens / wall) is recorded
with its ratio to target-only AR of the same run. One JSON line per (cell, method).

    python scripts/tree_tau.py --n 8 --new 96 --trees dyn15,4x2x1 --chains 15,4 --out tau.jsonl
    python scripts/tree_tau.py --device cuda --dtype bfloat16 --source /dev/shm/smol.gguf
"""
from __future__ import annotations

import argparse
import json

import torch
from tqdm import tqdm

from flashspec.core import Arm, SamplingParams, TreeShape
from flashspec.data import chat_ids, load_prompts
from flashspec.drafters import DraftContext, EagleDrafter, NgramDrafter
from flashspec.engine import SpecEngine
from flashspec.heads import LowRankChoice
from flashspec.metrics import alpha_by_depth
from flashspec.models import load_model
from flashspec.models.fused import fuse_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--seed", type=int, default=2027)
    ap.add_argument("--trees", default="dyn15", help="comma-separated tree shapes")
    ap.add_argument("--chains", default="15,4")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--source", default="smollm2")
    ap.add_argument("--out", default=None)
    ap.add_argument("--temperatures", default="0,1", help="comma-separated sampling temperatures")
    ap.add_argument("--drafter", choices=("eagle", "ngram"), default="eagle",
                    help="ngram: prompt lookup, its trees one continuation per branch (3x1x1x1)")
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok = load_model(args.source, dtype=args.dtype, device=args.device)
    if args.device == "cuda":
        fuse_model(model)       # the fused decode layers every other GPU step uses
    if args.drafter == "ngram":
        drafter = NgramDrafter()
    else:
        drafter = EagleDrafter.build(DraftContext(model, tok, args.device, args.dtype), "eagle",
                                     checkpoint="checkpoints/smollm2_eagle_lr72.safetensors",
                                     head=LowRankChoice(rank=72, init="trained"))
    arms = ([Arm(drafter.name, tree=TreeShape.parse(t)) for t in args.trees.split(",") if t]
            + [Arm(drafter.name, int(g)) for g in args.chains.split(",") if g])
    out = open(args.out, "w") if args.out else None
    eos = [int(tok.eos_token_id)]
    cuda = args.device == "cuda"
    kw = dict(eos_ids=eos, graphs=cuda, backend="triton" if cuda else "torch")
    for dataset in ("humaneval", "mtbench"):
        prompts = [chat_ids(tok, p.turns[:1], []) for p in load_prompts(dataset, n=args.n, seed=args.seed)]
        for temperature in (float(t) for t in args.temperatures.split(",")):
            params = SamplingParams(temperature)
            ar, ar_tps = None, None
            for arm in [Arm()] + arms:
                engine = SpecEngine(model, [arm], params=params, drafters=[drafter], **kw)
                engine.generate(prompts[:1], 16, seed=99)          # warm-up (graph capture)
                for p in prompts:   # and every prompt's prefill: kernels compile per length bucket
                    engine.generate([p], 2, seed=99)
                rows, wall = [], 0.0
                for i, p in enumerate(tqdm(prompts, desc=f"{dataset} T={temperature} {arm.label}", leave=False)):
                    res = engine.generate([p], args.new, seed=i)
                    rows.append(res.rows[0])
                    wall += res.wall_s
                tps = sum(len(r.tokens) for r in rows) / wall
                if arm.drafter is None:
                    ar, ar_tps = [r.tokens for r in rows], tps
                    continue
                steps = sum(r.steps for r in rows)
                acc = sum(r.n_accepted for r in rows)
                row = {"dataset": dataset, "temperature": temperature, "method": arm.label,
                       "verify_width": (arm.tree.size if arm.tree else arm.gamma) + 1,
                       "tau": (acc + steps) / steps, "steps": steps,
                       "alpha_by_depth": alpha_by_depth(r.accept_hist for r in rows),
                       "greedy_equal": all(r.tokens == a for r, a in zip(rows, ar)) if temperature == 0 else None,
                       "tps": tps, "ar_tps": ar_tps, "vs_ar": tps / ar_tps,
                       "prompts": args.n, "new_tokens": args.new, "seed": args.seed,
                       "device": args.device, "dtype": args.dtype, "wall_s": wall}
                line = json.dumps(row)
                print(line, flush=True)
                if out:
                    out.write(line + "\n")
                    out.flush()


if __name__ == "__main__":
    main()
