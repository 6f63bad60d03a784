#!/usr/bin/env python
"""Where one resident ``generate()`` call's time goes, and how many steps it launched past the
end: resident AR, the EAGLE chain at γ 4 and a draft tree, B = 1, greedy, on one GPU.

Each part is timed with host timers around a device sync (the stepper's ``_start``, its
``load``: prefill and drafters' start, the chunked decode ``run_chunks``, the reads at the end), over
``--n`` HumanEval prompts drawn with ``--seed``, after a warm-up of every engine on every
prompt. ``launched`` counts the steps the host launched per call, ``steps`` those in which the
row was live: the difference ran past the row's end (EOS or budget) and committed nothing.
``drafted_ahead``: the draftings queued ahead of the host's wait (one per chunk after the
first, and one past the end when a row ends at EOS).
``dead_step_us``: what a step costs once every row has finished.

    python scripts/device/generate_breakdown.py --gguf /dev/shm/smol.gguf [--seed 4747] [--out F]
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

import resident_bench
from tree_profile import timed
from flashspec import engine as engine_module
from flashspec.core import SamplingParams
from flashspec.data import chat_ids, load_prompts
from flashspec.drafters import NgramDrafter
from flashspec.models import load_model
from flashspec.models.fused import fuse_model

METHODS = ["eagle4_res", "tree_dyn15d6k4_res"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--eagle", default="checkpoints/smollm2_eagle_lr72.safetensors")
    ap.add_argument("--seed", type=int, default=4747)
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--out")
    a = ap.parse_args()
    out = open(a.out, "a") if a.out else None
    model, tok = load_model(a.gguf, dtype="bfloat16", device="cuda")
    model = fuse_model(model.eval(), True)
    eagle = resident_bench.drafter(model, tok, a.eagle, "cuda")
    engines = resident_bench.methods(model, eagle, NgramDrafter(), SamplingParams(0.0),
                                     [tok.eos_token_id], 1, a.eagle, ["dyn15d6k4"], METHODS)
    engines.pop("ar_ref")
    prompts = [chat_ids(tok, p.turns[:1], []) for p in load_prompts("humaneval", n=a.n, seed=a.seed)]
    seconds: dict[str, float] = defaultdict(float)
    engine_module.run_chunks = timed(seconds, "run_chunks", engine_module.run_chunks)
    for e in engines.values():
        for p in prompts:
            e.generate([p], 2, seed=1)
    for name, e in engines.items():
        loop, launched, ahead = e.stepper, [0], [0]
        e._start = timed(seconds, "_start", e._start)
        for part in ("load", "tokens", "histogram"):
            setattr(loop, part, timed(seconds, part, getattr(loop, part)))
        launch = loop.launch

        def counted(arm, n_steps, launch=launch, launched=launched):
            launched[0] += n_steps
            return launch(arm, n_steps)

        loop.launch = counted
        draft_ahead = loop.draft_ahead

        def counted_ahead(arm, draft_ahead=draft_ahead, ahead=ahead):
            ahead[0] += 1
            return draft_ahead(arm)

        loop.draft_ahead = counted_ahead
        e.generate([prompts[0]], a.new, seed=1)
        seconds.clear()
        launched[0] = ahead[0] = 0
        total, tokens, steps = 0.0, 0, 0
        for i, p in enumerate(prompts):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = e.generate([p], a.new, seed=1000 + i)
            torch.cuda.synchronize()
            total += time.perf_counter() - t0
            tokens += len(res.rows[0].tokens)
            steps += res.rows[0].steps
        with torch.inference_mode():     # a step after every row finished
            loop.state.finished.fill_(True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            launch(e._step_arms()[0], 100)
            torch.cuda.synchronize()
            dead_us = (time.perf_counter() - t0) * 1e4
        n = len(prompts)
        resident_bench.emit(out, check="breakdown", method=name, chunk=e.chunk,
                            ms_per_call=round(1e3 * total / n, 3), tokens=tokens / n,
                            steps=steps / n, launched=launched[0] / n,
                            drafted_ahead=ahead[0] / n,
                            parts_ms={k: round(1e3 * v / n, 3) for k, v in seconds.items()},
                            dead_step_us=round(dead_us, 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
