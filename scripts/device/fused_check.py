#!/usr/bin/env python
"""GPU check and timing of the fused decode layers (flashspec.models.fused); no Hydra, no hub.

A SmolLM2-shaped model with random weights (N(0, 0.05), as scripts/device/engine_check.py):

(a) fp32 exactness, fused vs reference layers on the same weights:
    ``forward``: logits/hidden/KV max-abs-diff of one cached step of width 1, 5, 9 at B=1, 4
    (ragged positions after a reference prefill); ``greedy_equal``: engine tokens and acceptance
    (target-only AR and n-gram γ=8, triton verify, graphs on and off, B=1 and 4).
(b) bf16 timing: CUDA-graph replay of the captured stepper's verify + commit of a chain step
    (:func:`settle_run`) at widths 1, 5, 9, B=1 and 32, reference vs fused, at a context of
    --context tokens (every row finished, so each replay runs at the same positions), plus the
    kernels per eager step (profiler) and the bf16 forward diff.

Prints one JSON line per result; exits 1 if an fp32 equality fails, 2 without CUDA.

    python scripts/device/fused_check.py                       # on the GPU (~1-2 min on an H200)
    python scripts/device/fused_check.py --device cpu --tiny   # code path on CPU (interpreter)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch  # torch does not import triton; TRITON_INTERPRET is set in main()


FP32_TOL = 1e-4     # max |fused - reference| / max |reference| of a forward, fp32


def args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny random Llama (for CPU runs)")
    ap.add_argument("--new", type=int, default=48, help="new tokens per greedy check")
    ap.add_argument("--context", type=int, default=512, help="positions of the timed steps")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--skip-timing", action="store_true")
    return ap.parse_args()


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def model_config(tiny: bool):
    from flashspec.models.loading import dummy_config
    if not tiny:
        return dummy_config("smollm2-135m")
    from transformers import AutoConfig
    return AutoConfig.for_model("llama", vocab_size=256, hidden_size=96, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                                max_position_embeddings=320, rope_theta=100000.0,
                                tie_word_embeddings=True)


def dummy_model(a, dtype, seed: int = 0):
    from flashspec.models.fused import fuse_model
    from flashspec.models.loading import random_model
    model = random_model(model_config(a.tiny), dtype, a.device, seed, std=0.05)
    return fuse_model(model.eval().requires_grad_(False))


def prompts(batch: int, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, vocab, (24,), generator=g).tolist()
    return [(base * 8)[b % 7: b % 7 + 30 + 9 * (b % 5)] for b in range(batch)]  # ragged, repeats


# ----------------------------------------------------------------------------- (a) exactness
def step(model, fused: bool, cache, tokens, pos):
    from flashspec.models.fused import LAYERS
    model.decode_layers = LAYERS if fused else None
    with torch.inference_mode():
        hidden = model.forward_hidden(tokens, pos, cache)
        return hidden, model.logits(hidden)


def forward_check(model, batch: int, width: int) -> bool:
    """One cached step after a reference prefill of ragged rows: fused vs reference."""
    vocab, dev = model.shape.vocab_size, model.device
    g = torch.Generator().manual_seed(batch * 100 + width)
    lengths = torch.tensor([40 + 23 * b for b in range(batch)])
    ref_cache = model.new_cache(batch, 256)
    prefill = torch.randint(0, vocab, (batch, int(lengths.max())), generator=g).to(dev)
    step(model, False, ref_cache, prefill, torch.arange(prefill.shape[1], device=dev).expand(batch, -1))
    fused_cache = model.new_cache(batch, 256)
    fused_cache.k.copy_(ref_cache.k)
    fused_cache.v.copy_(ref_cache.v)
    tokens = torch.randint(0, vocab, (batch, width), generator=g).to(dev)
    pos = (lengths[:, None] + torch.arange(width)).to(dev)
    h_ref, l_ref = step(model, False, ref_cache, tokens, pos)
    h_fus, l_fus = step(model, True, fused_cache, tokens, pos)
    rel = lambda a, b: float((a.float() - b.float()).abs().max() / b.float().abs().max())
    diffs = {"logits": rel(l_fus, l_ref), "hidden": rel(h_fus, h_ref),
             "k": rel(fused_cache.k, ref_cache.k), "v": rel(fused_cache.v, ref_cache.v)}
    ok = model.dtype != torch.float32 or max(diffs.values()) < FP32_TOL
    emit(check="forward", dtype=str(model.dtype).split(".")[-1], batch=batch, width=width, ok=ok,
         max_abs_logits=float((l_fus - l_ref).abs().max()),
         **{f"rel_{k}": f"{v:.2e}" for k, v in diffs.items()})
    return ok


def generate(model, fused: bool, arm, graphs: bool, batch: int, new: int, drafters=(),
             planner=None):
    from flashspec.engine import SpecEngine
    from flashspec.models.fused import LAYERS
    model.decode_layers = LAYERS if fused else None
    engine = SpecEngine(model, [arm], backend="triton", graphs=graphs, drafters=drafters,
                        planner=planner)
    res = engine.generate(prompts(batch, model.shape.vocab_size), new)
    return [r.tokens for r in res.rows], [r.accept_hist for r in res.rows], engine


def greedy_checks(model, new: int) -> bool:
    from flashspec.drafters import NgramDrafter
    from flashspec.core import Arm
    ok = True
    for graphs in (False, True):
        for arm in (Arm(), Arm("ngram", 8)):
            name = arm.label
            for batch in (1, 4):
                t0 = time.perf_counter()
                ref, ref_hist, _ = generate(model, False, arm, graphs, batch, new, [NgramDrafter()])
                got, got_hist, _ = generate(model, True, arm, graphs, batch, new, [NgramDrafter()])
                same = got == ref and got_hist == ref_hist
                ok &= same
                emit(check="greedy_equal", graphs=graphs, arm=name, batch=batch, equal=same,
                     tokens=sum(map(len, got)), wall_s=round(time.perf_counter() - t0, 2))
    return ok


# ----------------------------------------------------------------------------- (b) timing
def settle_run(engine, width: int, context: int):
    """(the verify + commit half of a chain step of ``width`` tokens at ``context``, whether a
    graph replays it): every row is marked finished, so the step commits nothing and each run
    scores the same positions."""
    from flashspec.core import Arm
    loop = engine.stepper
    arm = next(a for a in engine._step_arms() if a.tree is None and a.gamma == width - 1)
    loop.state.lengths.fill_(context + 1)
    loop.state.finished.fill_(True)
    entry = loop.graphs.get(arm)
    if entry is not None:
        return entry.settle.replay, True
    proposal = loop.propose(arm) if arm.drafts else None
    return (lambda: loop.settle(proposal) if proposal else loop.step(Arm())), False


@torch.inference_mode()   # the static buffers are inference tensors
def replay_ms(engine, width: int, context: int, replays: int) -> float:
    """Time per replay of the captured verify + commit of ``width`` tokens at ``context``."""
    run, _ = settle_run(engine, width, context)
    run()
    sync(engine.target.device)
    t0 = time.perf_counter()
    for _ in range(replays):
        run()
    sync(engine.target.device)
    return 1000 * (time.perf_counter() - t0) / replays


@torch.inference_mode()
def kernels_per_step(engine, width: int, context: int) -> int | None:
    """CUDA kernels launched by one eager run of the step (None where the profiler cannot)."""
    if engine.target.device.type != "cuda":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile
        loop = engine.stepper
        arm = next(a for a in engine._step_arms() if a.tree is None and a.gamma == width - 1)
        settle_run(engine, width, context)
        proposal = loop.propose(arm) if arm.drafts else None
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            loop.settle(proposal) if proposal else loop.step(arm)
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:   # noqa: BLE001 - informative only
        return None


def timing(a, model) -> None:
    from flashspec.drafters import NgramDrafter
    from flashspec.core import Arm
    from flashspec.planner import WidthPlanner
    for batch in ((1, 4) if a.tiny else (1, 32)):
        for fused in (False, True):
            t0 = time.perf_counter()
            # the planner's engine captures every width up to γ + 1
            _, _, engine = generate(model, fused, Arm("ngram", 8), True, batch, 8, [NgramDrafter()],
                                    planner=WidthPlanner())
            cold = time.perf_counter() - t0
            for width in (1, 5, 9):
                for context in sorted({128, a.context}):
                    if context + width > engine.cache.capacity:
                        continue
                    emit(check="replay", dtype=str(model.dtype).split(".")[-1], batch=batch,
                         width=width, fused=fused, context=context,
                         ms=round(replay_ms(engine, width, context, a.replays), 4),
                         graph=settle_run(engine, width, context)[1],
                         kernels=(kernels_per_step(engine, width, context)
                                  if context == a.context else None),
                         cold_start_s=round(cold, 2))
            del engine
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def main() -> int:
    a = args()
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        emit(check="setup", ok=False, error="CUDA is not available; run on a GPU or pass "
             "--device cpu --tiny (Triton interpreter)")
        return 2
    if a.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        emit(check="setup", ok=False, error="--device cpu needs TRITON_INTERPRET=1")
        return 2
    if a.device == "cpu":
        a.replays = min(a.replays, 2)
    ok = True
    model = dummy_model(a, torch.float32)
    for batch in (1, 4):
        for width in (1, 5, 9):
            ok &= forward_check(model, batch, width)
    ok &= greedy_checks(model, a.new)
    del model
    if not a.skip_timing:
        model = dummy_model(a, torch.float32 if a.device == "cpu" else torch.bfloat16)
        for width in (1, 9):
            forward_check(model, 4, width)
        timing(a, model)
    emit(check="done", ok=ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
