#!/usr/bin/env python
"""Where a tree step's time goes (GPU): per-phase wall time of the eager tree step (the
reference stepper, ``flashspec.stepper``) and the host syncs it makes, next to a chain step of
the same drafter.

Each phase (drafting, ``tree_attention``: the ancestors, the masks being built lazily inside
the target forward; target forward, verify, K/V compaction) is timed with a device
synchronisation on both sides, so the phases add up to more than an unsynchronised step; the
point is their proportions. Then one generation runs under torch.profiler and the ops with the
most self CPU time (and the ``aten::item`` / ``aten::_local_scalar_dense`` count: host reads of
device values) are printed.

    python scripts/device/tree_profile.py --source /dev/shm/smol.gguf --tree dyn15d8k3
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import time

import torch

from flashspec import stepper as stepper_mod
from flashspec.core import Arm, SamplingParams, TreeShape
from flashspec.data import chat_ids, load_prompts
from flashspec.drafters import DraftContext, EagleDrafter
from flashspec.engine import SpecEngine
from flashspec.heads import LowRankChoice
from flashspec.models import load_model
from flashspec.models.fused import fuse_model


def timed(table: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        table[name] += time.perf_counter() - t
        return out
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tree", default="dyn15d8k3")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    model, tok = load_model(args.source, dtype=args.dtype, device="cuda")
    fuse_model(model)
    eagle = EagleDrafter.build(DraftContext(model, tok, "cuda", args.dtype), "eagle",
                               checkpoint="checkpoints/smollm2_eagle_lr72.safetensors",
                               head=LowRankChoice(rank=72, init="trained"))
    prompt = chat_ids(tok, load_prompts("humaneval", n=1, seed=7)[0].turns[:1], [])
    params = SamplingParams(args.temperature)
    eos = [int(tok.eos_token_id)]
    for arm in (Arm(eagle.name, tree=TreeShape.parse(args.tree)), Arm(eagle.name, 4), Arm()):
        engine = SpecEngine(model, [arm], params=params, eos_ids=eos, backend="triton",
                            drafters=[eagle])
        engine.generate([prompt], 16, seed=1)
        res = engine.generate([prompt], args.new, seed=2)
        row = res.rows[0]
        print(f"{arm.label}: {len(row.tokens) / res.wall_s:.1f} tok/s, {row.steps} steps, "
              f"{1e3 * res.wall_s / row.steps:.2f} ms/step", flush=True)
        if arm.tree is None:
            device_table(engine, prompt)
            continue
        phases: dict = collections.defaultdict(float)
        stepper = engine.stepper
        saved = (eagle.draft_tree, model.forward_hidden, stepper.backend,
                 engine.cache.move, stepper_mod.tree_attention)
        eagle.draft_tree = timed(phases, "draft", eagle.draft_tree)
        model.forward_hidden = timed(phases, "target forward", model.forward_hidden)
        impl = stepper.backend
        stepper.backend = dataclasses.replace(impl, verify_tree=timed(phases, "verify",
                                                                      impl.verify_tree))
        engine.cache.move = timed(phases, "kv move", engine.cache.move)
        stepper_mod.tree_attention = timed(phases, "tree_attention", stepper_mod.tree_attention)
        torch.cuda.synchronize()
        t = time.perf_counter()
        res = engine.generate([prompt], args.new, seed=2)
        wall = time.perf_counter() - t
        steps = res.rows[0].steps
        for name, s in sorted(phases.items(), key=lambda kv: -kv[1]):
            print(f"  {name:16s} {1e3 * s / steps:7.2f} ms/step", flush=True)
        print(f"  {'total (synced)':16s} {1e3 * wall / steps:7.2f} ms/step", flush=True)
        (eagle.draft_tree, model.forward_hidden, stepper.backend, engine.cache.move,
         stepper_mod.tree_attention) = saved
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.generate([prompt], 32, seed=3)
        ev = prof.key_averages()
        syncs = sum(e.count for e in ev if e.key in ("aten::item", "aten::_local_scalar_dense"))
        print(f"  host reads (aten::item) in 32 tokens: {syncs}", flush=True)
        print(ev.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        device_table(engine, prompt)


def device_table(engine: SpecEngine, prompt: list[int], new: int = 32) -> None:
    """GPU time per kernel over ``new`` tokens, most first, per step of the generation."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        res = engine.generate([prompt], new, seed=4)
        torch.cuda.synchronize()
    steps = res.rows[0].steps
    ev = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in ev)
    print(f"  device time {total / steps:.0f} us/step over {steps} steps; top kernels:", flush=True)
    for e in ev[:18]:
        print(f"    {e.self_device_time_total / steps:8.1f} us/step {e.count / steps:5.1f}x  "
              f"{e.key[:90]}", flush=True)


if __name__ == "__main__":
    main()
