#!/usr/bin/env python
"""What of the resident bench cannot be a decode job (no Hydra): a kernel profile of one
resident step per arm, and step costs at scale with random weights. The bench itself (every
method of a cell side by side against the resident AR, pooled tok/s, α, τ, greedy equality) is
``python run.py experiment=bench`` (conf/experiment/bench.yaml; scripts/device/bench.sh runs
its cells); :func:`methods` and :func:`drafter` stay for scripts/device/generate_breakdown.py
and resident_breakdown.py.

    python scripts/device/resident_bench.py --gguf /dev/shm/smollm2.gguf --profile [--trees dyn15d6k4]
    python scripts/device/resident_bench.py --scale     # 8B-shaped target, 1B-shaped drafter

``--profile``: kernels of one resident step (graph replays under torch.profiler), its replay
time and the torch ops each flashspec line issues. ``--scale``: random weights (acceptance is
meaningless), so only step costs: one resident step of target-only AR and of the 1B drafter at
γ (graph replays), and the speedup they predict at α = 0.6 / 0.7 / 0.8 (i.i.d. acceptance):
E[tokens | α, γ] · T_ar / T_step(γ).
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashspec.bandits import UCB1
from flashspec.core import Arm, SamplingParams, TreeShape
from flashspec.data import chat_ids, load_prompts
from flashspec.drafters import DraftContext, EagleDrafter, ModelDrafter, NgramDrafter
from flashspec.engine import SpecEngine
from flashspec.heads import LowRankChoice
from flashspec.models import load_model
from flashspec.models.fused import fuse_model
from flashspec.models.loading import dummy_config, random_model
from flashspec.planner import WidthPlanner
from flashspec.theory import expected_tau
from flashspec.verify import get_backend

def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def emit(out, **row) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def methods(model, eagle: EagleDrafter, ngram: NgramDrafter, params: SamplingParams, eos: list[int],
            batch: int, checkpoint: str, trees: list[str], only: list[str] | None
            ) -> dict[str, SpecEngine]:
    """The engines of a cell (``only``: the names to keep; AR of both loops always runs)."""
    keep = lambda name: only is None or name in ("ar_ref", "ar_res") or name in only
    kw = dict(params=params, backend=get_backend("triton"), seed=0, eos_ids=eos, graphs=True,
              drafters=[eagle, ngram])
    res = dict(kw, resident=True)
    make = {
        "ar_ref": lambda: SpecEngine(model, [Arm()], **kw),
        "ar_res": lambda: SpecEngine(model, [Arm()], **res),
        "eagle4_ref": lambda: SpecEngine(model, [Arm(eagle.name, 4)], **kw),
        "eagle3_res": lambda: SpecEngine(model, [Arm(eagle.name, 3)], **res),
        "eagle4_res": lambda: SpecEngine(model, [Arm(eagle.name, 4)], **res),
        "eagle5_res": lambda: SpecEngine(model, [Arm(eagle.name, 5)], **res),
        "eagle15_res": lambda: SpecEngine(model, [Arm(eagle.name, 15)], **res),   # a tree's width
        "eagle5_res_planner": lambda: SpecEngine(model, [Arm(eagle.name, 5)], planner=WidthPlanner(), **res),
        "ngram8_res": lambda: SpecEngine(model, [Arm(ngram.name, 8)], **res),
        "ngram8_res_planner": lambda: SpecEngine(model, [Arm(ngram.name, 8)], planner=WidthPlanner(), **res),
        "ngram12_res": lambda: SpecEngine(model, [Arm(ngram.name, 12)], **res),   # the width of 3x1x1x1
        # n-gram lookup as a draft tree: three continuations, four deep
        "ngram_3x1x1x1_res": lambda: SpecEngine(
            model, [Arm(ngram.name, tree=TreeShape.parse("3x1x1x1"))], **res),
        "ngram_3x1x1x1_res_planner": lambda: SpecEngine(
            model, [Arm(ngram.name, tree=TreeShape.parse("3x1x1x1"))], planner=WidthPlanner(), **res),
    }
    for i, spec in enumerate(trees):   # draft trees in the resident loop
        arm = Arm(eagle.name, tree=TreeShape.parse(spec))
        make[f"tree_{arm.tree.label}_res"] = lambda arm=arm: SpecEngine(model, [arm], **res)
        make[f"tree_{arm.tree.label}_ref"] = lambda arm=arm: SpecEngine(model, [arm], **kw)
        if i == 0:
            make[f"tree_{arm.tree.label}_res_planner"] = lambda arm=arm: SpecEngine(
                model, [arm], planner=WidthPlanner(), **res)
            # the bandit choosing between the chain and the tree by tokens per second
            make[f"eagle4_tree_{arm.tree.label}_res_ucb"] = lambda arm=arm: SpecEngine(
                model, [Arm(eagle.name, 4), arm], policy=UCB1(2, reward="tps", reward_scale=4000.0),
                **res)
    if not params.greedy:   # drafter calibration at T > 0: flatter / sharper draft distributions
        for t in (0.7, 1.4):
            hot = drafter(model, None, checkpoint, str(model.device), t) if keep(
                f"eagle3_res_dt{t}") else None
            make[f"eagle3_res_dt{t}"] = lambda hot=hot: SpecEngine(model, [Arm(hot.name, 3)],
                                                                   **{**res, "drafters": [hot]})
    if batch > 1:  # the reference loop's speculative step is the slow one at batch 32
        make["eagle4_ref_planner"] = lambda: SpecEngine(model, [Arm(eagle.name, 4)], planner=WidthPlanner(), **kw)
    return {name: build() for name, build in make.items() if keep(name)}


def drafter(model, tok, checkpoint: str, device: str, draft_temperature: float = 1.0
            ) -> EagleDrafter:
    """The trained EAGLE drafter with the rank-72 head trained with it (the default config's
    ``head=lowrank``, d/8): its features are fitted to that head, not to the target's."""
    ctx = DraftContext(model, tok, device, str(model.dtype).removeprefix("torch."))
    return EagleDrafter.build(ctx, "eagle", checkpoint=checkpoint,
                              head=LowRankChoice(rank=72, init="trained"),
                              draft_temperature=draft_temperature)


def profile(model, tok, checkpoint: str, out, gamma: int = 4, trees: list[str] = (),
            temperature: float = 0.0) -> None:
    """Kernels of one resident step at B = 1 (20 graph replays under torch.profiler), every
    kernel name with its launches and µs per step: AR, the EAGLE chain at γ and each
    draft-tree shape of ``trees``, sampling at ``temperature`` (0: greedy)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    eagle = drafter(model, tok, checkpoint, "cuda")
    prompt = chat_ids(tok, load_prompts("humaneval", n=1, seed=7)[0].turns[:1], [])
    arms = [Arm(), Arm(eagle.name, gamma)] + [Arm(eagle.name, tree=TreeShape.parse(t)) for t in trees]
    for arm in arms:
        e = SpecEngine(model, [arm], backend=get_backend("triton"), graphs=True, resident=True,
                       eos_ids=[tok.eos_token_id], params=SamplingParams(temperature),
                       drafters=[eagle])
        e.generate([prompt], 64)
        e.stepper.state.budgets.fill_(1 << 20)
        e.stepper.state.finished.zero_()
        e.stepper.launch(arm, 3)
        sync()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            e.stepper.launch(arm, 20)
            sync()
        events = [ev for ev in prof.key_averages() if ev.device_type.name == "CUDA"]
        total = sum(ev.device_time_total for ev in events) / 20
        kernels = sum(ev.count for ev in events) / 20
        emit(out, check="profile", arm=arm.label, temperature=temperature, kernels_per_step=kernels,
             gpu_us_per_step=round(total, 1))
        for ev in sorted(events, key=lambda ev: -ev.device_time_total):
            emit(out, check="kernel", arm=arm.label, name=ev.key[:90], per_step=ev.count / 20,
                 us_per_step=round(ev.device_time_total / 20, 1))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        e.stepper.launch(arm, 50)
        end.record()
        sync()
        emit(out, check="replay", arm=arm.label, step_ms=round(start.elapsed_time(end) / 50, 4))
        graphs = e.stepper.graphs[arm]
        if graphs.draft is not None:     # the drafting half alone: what a step past the end costs
            start.record()
            for _ in range(50):
                graphs.draft.replay()
            end.record()
            sync()
            emit(out, check="replay_drafting", arm=arm.label,
                 draft_ms=round(start.elapsed_time(end) / 50, 4))
        for (where, op), n in census(lambda: e.stepper.step(arm)).most_common():
            emit(out, check="torch_op", arm=arm.label, where=where, op=op, per_step=n)


# aten ops that only make views or allocate: no kernel of their own
_NO_KERNEL = ("view", "_unsafe_view", "reshape", "expand", "slice", "select", "unsqueeze",
              "squeeze", "t", "transpose", "permute", "as_strided", "alias", "detach", "unbind",
              "split", "narrow", "empty", "empty_strided", "empty_like", "lift_fresh", "_reshape_alias")


def census(step) -> Counter[tuple[str, str]]:
    """The torch ops one eager call of ``step`` issues, views and allocations left out (Triton
    kernels are not torch ops and do not appear; an op that turns out a no-op, such as ``to``
    a tensor's own dtype, is still counted), each keyed by the innermost flashspec source line
    that issued it: where a step's small torch kernels come from."""
    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in _NO_KERNEL:
                frames = [f for f in traceback.extract_stack() if "/flashspec/" in f.filename]
                where = (f"{frames[-1].filename.rsplit('/flashspec/', 1)[1]}:{frames[-1].lineno}"
                         if frames else "?")
                self.seen[(where, name)] += 1
            return func(*args, **(kwargs or {}))

    with Count() as mode:
        step()
    sync()
    return mode.seen


@torch.inference_mode()
def scale(out, gamma: int = 4) -> None:
    """Resident step costs of an 8B-shaped target with a 1B-shaped drafter (random bf16)."""
    target = fuse_model(random_model(dummy_config("llama-3.1-8b"), torch.bfloat16, "cuda", 0).eval())
    small = fuse_model(random_model(dummy_config("llama-3.2-1b"), torch.bfloat16, "cuda", 1).eval())
    drafter = ModelDrafter(small, None, name="llama1b")
    for batch in (1, 8):
        prompts = [list(range(100 + b, 100 + b + 512)) for b in range(batch)]
        times = {}
        for g in (0, gamma):
            arm = Arm(drafter.name, g) if g else Arm()
            e = SpecEngine(target, [arm], backend=get_backend("triton"), graphs=True, resident=True,
                           drafters=[drafter])
            e.generate(prompts, 8)            # capture + prefill; the loop stays loaded
            loop = e.stepper
            loop.state.budgets.fill_(1 << 20)
            loop.state.finished.zero_()
            for _ in range(3):
                loop.launch(arm, 1)
            sync()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loop.launch(arm, 50)
            end.record()
            sync()
            times[g] = start.elapsed_time(end) / 50
            emit(out, check="scale_step", batch=batch, gamma=g, step_ms=round(times[g], 3))
            del e
            torch.cuda.empty_cache()
        for a in (0.6, 0.7, 0.8):
            emit(out, check="scale_predicted", batch=batch, gamma=gamma, alpha=a,
                 speedup=round(expected_tau(a, gamma) * times[0] / times[gamma], 3))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf")
    ap.add_argument("--eagle", default="checkpoints/smollm2_eagle_lr72.safetensors")
    ap.add_argument("--scale", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-temperature", type=float, default=0.0,
                    help="sampling temperature of the profiled steps (0: greedy)")
    ap.add_argument("--trees", nargs="*", default=["dyn15d6k4"], help="draft-tree shapes profiled")
    ap.add_argument("--out")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    if not (a.scale or a.profile):
        ap.error("give --profile or --scale; the bench's cells are `python run.py experiment=bench` "
                 "(scripts/device/bench.sh)")
    out = open(a.out, "a") if a.out else None
    emit(out, check="device", torch=torch.__version__, name=torch.cuda.get_device_name())
    if a.scale:
        scale(out)
        return 0
    model, tok = load_model(a.gguf, dtype=a.dtype, device="cuda")
    model = fuse_model(model.eval(), True)
    with torch.inference_mode():
        profile(model, tok, a.eagle, out, trees=a.trees, temperature=a.profile_temperature)
    return 0


if __name__ == "__main__":
    sys.exit(main())
