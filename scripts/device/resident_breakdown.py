#!/usr/bin/env python
"""Where a resident generation's wall time goes (GPU), per method, at B = 1.

For each prompt (drawn with ``--seed``) and method, after a warm-up of every prompt:

- ``total``: one whole ``generate`` call (what the benchmarks time);
- ``setup``: its start alone, timed with a synchronisation on both sides: ``prefill`` (the
  target's prefill and the engine's start), ``drafter`` (the drafter's own prefill), ``load``
  (the device state);
- ``steps_used`` / ``steps_launched``: steps the row was live in against steps the loop
  launched (the ones past the row's end commit nothing but cost time);
- ``replay_ms``: one step as a graph replay, from 40 back-to-back replays between two events
  (the device cost of a step, gaps between its kernels included).

``total - setup - steps_launched * replay_ms`` is what the host adds while driving the loop.

    python scripts/device/resident_breakdown.py --gguf /dev/shm/smol.gguf --n 8 --seed 515 \
        [--dataset mtbench] [--temperature 1.0] [--gammas 0,3,4]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from flashspec.core import Arm, SamplingParams
from flashspec.data import chat_ids, load_prompts
from flashspec.engine import SpecEngine
from flashspec.models import load_model
from flashspec.models.fused import fuse_model
from flashspec.resident import ResidentLoop
from flashspec.verify import get_backend

from resident_bench import drafter


def sync() -> None:
    torch.cuda.synchronize()


def replay_ms(engine: SpecEngine, arm: Arm, n: int = 40) -> float:
    loop = engine.stepper
    loop.state.budgets.fill_(1 << 20)
    loop.state.finished.zero_()
    loop.launch(arm, 3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    loop.launch(arm, n)
    end.record()
    sync()
    return start.elapsed_time(end) / n


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--eagle", default="checkpoints/smollm2_eagle_lr72.safetensors")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--seed", type=int, default=515)
    ap.add_argument("--gammas", default="0,3,4")
    ap.add_argument("--temperature", type=float, default=0.0)
    a = ap.parse_args()
    model, tok = load_model(a.gguf, dtype="bfloat16", device="cuda")
    model = fuse_model(model.eval(), True)
    eagle = drafter(model, tok, a.eagle, "cuda")
    prompts = [chat_ids(tok, p.turns[:1], []) for p in load_prompts(a.dataset, n=a.n, seed=a.seed)]
    launched = {"n": 0}
    launch = ResidentLoop.launch

    def counting(self, arm, n_steps):
        launched["n"] += n_steps
        return launch(self, arm, n_steps)

    ResidentLoop.launch = counting
    for g in (int(x) for x in a.gammas.split(",")):
        arm = Arm(eagle.name, g) if g else Arm()
        e = SpecEngine(model, [arm], backend=get_backend("triton"), graphs=True, resident=True,
                       eos_ids=[tok.eos_token_id], seed=0, drafters=[eagle],
                       params=SamplingParams(temperature=a.temperature))
        for p in prompts:
            e.generate([p], 4, seed=1)
        sync()
        rows = []
        for i, p in enumerate(prompts):
            launched["n"] = 0
            t0 = time.perf_counter()
            res = e.generate([p], a.new, seed=10 + i)
            sync()
            total = time.perf_counter() - t0
            n_launched = launched["n"]
            t0 = time.perf_counter()
            stepper = e._start([p], a.new)
            sync()
            t1 = time.perf_counter()
            stepper.load([p], a.new, 0, 0)      # prefill, drafters' start, device state
            sync()
            t3 = time.perf_counter()
            setup = t3 - t0
            step = replay_ms(e, arm)
            r = res.rows[0]
            rows.append(dict(total_ms=total * 1e3, setup_ms=setup * 1e3, prepare_ms=(t1 - t0) * 1e3,
                             load_ms=(t3 - t1) * 1e3, replay_ms=step,
                             steps_used=r.steps, steps_launched=n_launched,
                             tokens=len(r.tokens), prompt=len(p)))
        agg = {k: round(sum(r[k] for r in rows) / len(rows), 3) for k in rows[0]}
        host = agg["total_ms"] - agg["setup_ms"] - agg["steps_launched"] * agg["replay_ms"]
        print(json.dumps(dict(dataset=a.dataset, temperature=a.temperature, gamma=g, **agg, host_ms=round(host, 2),
                              tps=round(sum(r["tokens"] for r in rows)
                                        / sum(r["total_ms"] for r in rows) * 1e3, 1))), flush=True)


if __name__ == "__main__":
    main()
