#!/usr/bin/env python
"""The resident loop against the reference loop and target-only AR, on one GPU (no Hydra).

Every method of a cell runs in one process on the same prompts, drawn with ``--seed`` from the
eval split (a seed the committed records do not use), interleaved prompt by prompt with the
method order rotating, after a warm-up call per engine (graph capture) and an untimed prefill of
every prompt by every engine (kernels compiled per prompt-length bucket). Reported per method:
pooled tok/s (all new tokens / all decode time), the ratio to the reference loop's AR, α, τ,
and whether greedy output equals AR's token for token. MT-Bench: first turns only.

    python scripts/device/resident_bench.py --gguf /dev/shm/smollm2.gguf --cells he_b1 mt_b1 \
        he_b1_t1 mt_b1_t1 he_b32 [--n 8] [--new 128] [--out results.jsonl]
    python scripts/device/resident_bench.py --scale     # 8B-shaped target, 1B-shaped drafter

``--scale``: random weights (acceptance is meaningless), so only step costs: one resident step
of target-only AR and of the 1B drafter at γ (graph replays), and the speedup they predict at
α = 0.6 / 0.7 / 0.8 (i.i.d. acceptance): E[tokens | α, γ] · T_ar / T_step(γ).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
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

CELLS = {  # name: (dataset, batch, temperature)
    "he_b1": ("humaneval", 1, 0.0), "mt_b1": ("mtbench", 1, 0.0),
    "he_b1_t1": ("humaneval", 1, 1.0), "mt_b1_t1": ("mtbench", 1, 1.0),
    "he_b32": ("humaneval", 32, 0.0), "mt_b8": ("mtbench", 8, 0.0),
}


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


def run_cell(name: str, model, tok, eagle_ckpt: str, n: int, new: int, seed: int, out,
             device: str, trees: list[str], only: list[str] | None,
             eagle_b: str | None = None) -> None:
    """One cell; ``eagle_b``: a second drafter checkpoint whose EAGLE methods (suffix ``_b``)
    run beside the first's on the same prompts, interleaved with them."""
    dataset, batch, temperature = CELLS[name]
    params = SamplingParams(temperature=temperature)
    prompts = [chat_ids(tok, p.turns[:1], []) for p in load_prompts(dataset, n=max(n, batch),
                                                                        seed=seed)]
    eagle = drafter(model, tok, eagle_ckpt, device)
    engines = methods(model, eagle, NgramDrafter(), params, [tok.eos_token_id], batch, eagle_ckpt,
                      trees, only)
    if eagle_b is not None:
        second = methods(model, drafter(model, tok, eagle_b, device), NgramDrafter(), params,
                         [tok.eos_token_id], batch, eagle_b, trees, only)
        engines.update({f"{m}_b": e for m, e in second.items()
                        if m not in ("ar_ref", "ar_res") and ("eagle" in m or "tree" in m)})
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    t_cold = {}
    for m, e in engines.items():
        t0 = time.perf_counter()
        e.generate(groups[0], 16, seed=1)
        sync()
        t_cold[m] = round(time.perf_counter() - t0, 2)
    # Kernels specialise on prompt-length buckets: the first method to meet a new bucket would
    # pay its compilation inside its timed call (with a fixed rotation, the same method every
    # run). Every engine prefills every group once before timing.
    t0 = time.perf_counter()
    for e in engines.values():
        for group in groups:
            e.generate(group, 2, seed=1)
    sync()
    emit(out, cell=name, warm_all_prompts_s=round(time.perf_counter() - t0, 2))
    stats = {m: dict(tokens=0, seconds=0.0, steps=0, accepted=0, proposed=0, outs=[], per=[],
                     capture=0.0) for m in engines}
    order = list(engines)
    for g, group in enumerate(groups):
        for m in order[g % len(order):] + order[:g % len(order)]:
            sync()
            captured = engines[m].capture_s
            t0 = time.perf_counter()
            res = engines[m].generate(group, new, seed=1000 + g)
            sync()
            s = stats[m]
            dt = time.perf_counter() - t0
            s["seconds"] += dt
            s["capture"] += engines[m].capture_s - captured
            s["per"].append(sum(len(r.tokens) for r in res.rows) / dt)
            for r in res.rows:
                s["tokens"] += len(r.tokens)
                s["steps"] += r.steps
                s["accepted"] += r.n_accepted
                s["proposed"] += r.n_proposed
                s["outs"].append(r.tokens)
    base = stats["ar_ref"]["tokens"] / stats["ar_ref"]["seconds"]
    ref_per = stats["ar_ref"]["per"]
    for m, s in stats.items():
        tps = s["tokens"] / s["seconds"]
        ratios = sorted(a / b for a, b in zip(s["per"], ref_per))
        emit(out, cell=name, method=m, batch=batch, temperature=temperature, n_prompts=len(prompts),
             new=new, tps=round(tps, 1), vs_ar_ref=round(tps / base, 3),
             median_group_ratio=round(ratios[len(ratios) // 2], 3),
             alpha=round(s["accepted"] / s["proposed"], 3) if s["proposed"] else None,
             tau=round(s["tokens"] / max(s["steps"], 1), 3),
             greedy_equal=(s["outs"] == stats["ar_ref"]["outs"]) if temperature == 0 else None,
             cold_s=t_cold[m], capture_in_timed_s=round(s["capture"], 3),
             per_group_tps=[round(x) for x in s["per"]])


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
    ap.add_argument("--eagle-b", help="a second drafter checkpoint, its methods suffixed _b")
    ap.add_argument("--cells", nargs="*", default=list(CELLS))
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--scale", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-temperature", type=float, default=0.0,
                    help="sampling temperature of the profiled steps (0: greedy)")
    ap.add_argument("--trees", nargs="*", default=["dyn15d8k3"],
                    help="draft-tree shapes run as resident arms (the first also with the planner)")
    ap.add_argument("--methods", nargs="*", help="only these methods (AR always runs)")
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the code path")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    out = open(a.out, "a") if a.out else None
    emit(out, check="device", torch=torch.__version__,
         name=torch.cuda.get_device_name() if a.device == "cuda" else "cpu")
    if a.scale:
        scale(out)
        return 0
    model, tok = load_model(a.gguf, dtype=a.dtype, device=a.device)
    model = fuse_model(model.eval(), a.device == "cuda")
    if a.profile:
        with torch.inference_mode():
            profile(model, tok, a.eagle, out, trees=a.trees, temperature=a.profile_temperature)
        return 0
    for cell in a.cells:
        t0 = time.perf_counter()
        run_cell(cell, model, tok, a.eagle, a.n, a.new, a.seed, out, a.device, a.trees, a.methods,
                 a.eagle_b)
        emit(out, cell=cell, wall_s=round(time.perf_counter() - t0, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
