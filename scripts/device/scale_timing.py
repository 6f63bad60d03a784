#!/usr/bin/env python
"""Step costs at a realistic scale: a Llama-3.1-8B-shaped target and a Llama-3.2-1B-shaped
drafter with random weights (bf16, one GPU), timed as the engine runs them.

Random weights make acceptance meaningless, so this measures only costs: the target's verify +
commit (CUDA-graph replay of the captured stepper's step half, flashspec.resident) at widths
1..γ+1, one drafter forward of one token per row run eagerly, and ModelDrafter's whole γ-token
drafting (its window of γ + 1 committed tokens, then γ drafts) replayed as one CUDA graph
(flashspec.graphs.GraphCache), per drafted token. The speedup a real pair would
get is then predicted from stated acceptance rates α (i.i.d. per token):

    speedup(α, γ) = (1 - α^(γ+1)) / (1 - α) · T_verify(1) / (γ · T_draft + T_verify(γ + 1))

One JSON line per measurement and per prediction; ``--out`` also writes them to a file.

    python scripts/device/scale_timing.py [--batch 1 8] [--context 1024] [--fused] [--out f.jsonl]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from flashspec.core import Arm, SamplingParams
from flashspec.drafters import ModelDrafter, NgramDrafter
from flashspec.engine import SpecEngine
from flashspec.graphs import GraphCache
from flashspec.models.fused import fuse_model
from flashspec.models.loading import dummy_config, random_model
from flashspec.planner import WidthPlanner
from flashspec.theory import expected_tau

ALPHAS = (0.6, 0.7, 0.8)


def cuda_ms(fn, n: int = 50) -> float:
    """Mean GPU time of ``fn`` over ``n`` runs (after 3 warm-ups), in ms (wall time on CPU)."""
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():   # the --device cpu dry run of the code path
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return 1000 * (time.perf_counter() - t0) / n
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def dummy(source: str, dtype: torch.dtype, device: str, seed: int):
    """A random-weight model of a named shape (``dummy:<shape>``); no tokenizer needed."""
    return random_model(dummy_config(source.removeprefix("dummy:")), dtype, device, seed).eval()


def verify_costs(target, batch: int, gamma: int, context: int) -> dict[int, float]:
    """Graph replay time of the target's verify + commit at widths 1..gamma+1 (batch rows;
    every row finished, so each replay scores the same positions)."""
    engine = SpecEngine(target, [Arm("ngram", gamma)], backend="triton", graphs=True,
                        drafters=[NgramDrafter()], planner=WidthPlanner())  # every width captured
    prompts = [[1 + (i * 7 + b) % 1000 for i in range(context)] for b in range(batch)]
    engine.generate(prompts, 4)       # builds the cache and captures every width
    loop, costs = engine.stepper, {}
    for width in range(1, gamma + 2):
        arm = Arm("ngram", width - 1) if width > 1 else Arm()
        loop.state.lengths.fill_(context + 1)
        loop.state.finished.fill_(True)
        costs[width] = cuda_ms(loop.graphs[arm].settle.replay)
    return costs


def draft_cost(drafter, batch: int, context: int) -> float:
    """One eager drafter forward (one token per row, head included) at ``context``."""
    cache = drafter.new_cache(batch, context + 64)
    dev = drafter.device
    prefill = torch.arange(context, device=dev).expand(batch, context) % 1000
    drafter.forward_hidden(prefill, torch.arange(context, device=dev).expand(batch, context), cache,
                           span=context)
    tok = torch.ones(batch, 1, dtype=torch.long, device=dev)
    pos = torch.full((batch, 1), context, device=dev)
    return cuda_ms(lambda: drafter.logits(drafter.forward_hidden(tok, pos, cache, span=context + 1)))


def graphed_draft_cost(model, batch: int, context: int, gamma: int) -> float:
    """ms per drafted token of ModelDrafter's γ-token drafting replayed as one CUDA graph."""
    drafter = ModelDrafter(model, name="draft")
    drafter.reset(batch, context + 64)
    dev = model.device
    tokens = (torch.arange(context + 64, device=dev) % 1000).expand(batch, -1).contiguous()
    lengths = torch.full((batch,), context, device=dev)
    drafter.start(tokens[:, :context], lengths, None)
    graphs = GraphCache(lambda key, t, n, s: drafter.draft(t, n, gamma, SamplingParams(), s),
                        capture=dev.type == "cuda")
    args = (tokens, lengths, torch.zeros((), dtype=torch.long, device=dev))
    graphs("draft", *args)
    slot = graphs.slots["draft"]
    run = slot.graph.replay if slot.graph is not None else (lambda: graphs("draft", *args))
    return cuda_ms(run) / gamma


def predictions(t_verify: dict[int, float], t_draft: float, batch: int, how: str) -> list[dict]:
    rows = []
    for alpha in ALPHAS:
        for gamma in range(1, len(t_verify)):
            tokens = expected_tau(alpha, gamma)
            step = gamma * t_draft + t_verify[gamma + 1]
            rows.append({"kind": "predicted", "batch": batch, "alpha": alpha, "gamma": gamma,
                         "drafting": how,
                         "tau": round(tokens, 3), "step_ms": round(step, 3),
                         "speedup": round(tokens * t_verify[1] / step, 3)})
    return rows


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="dummy:llama-3.1-8b")
    ap.add_argument("--drafter", default="dummy:llama-3.2-1b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--fused", action="store_true", help="fused decode layers (fused.fuse_model)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the code path (no timings)")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("scale_timing needs a CUDA GPU (timings are GPU-only)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    target = dummy(a.target, dtype, a.device, seed=0)
    drafter = dummy(a.drafter, dtype, a.device, seed=1)
    if a.fused:
        fuse_model(target), fuse_model(drafter)
    lines = [{"kind": "setup", "target": a.target, "drafter": a.drafter, "fused": a.fused,
              "context": a.context,
              "gpu": torch.cuda.get_device_name() if a.device == "cuda" else "none (dry run)",
              "load_s": round(time.perf_counter() - t0, 1)}]
    for batch in a.batch:
        t_verify = verify_costs(target, batch, a.gamma, a.context)
        t_draft = draft_cost(drafter, batch, a.context)
        t_graph = graphed_draft_cost(drafter, batch, a.context, a.gamma)
        lines.append({"kind": "measured", "batch": batch, "draft_ms": round(t_draft, 3),
                      "draft_graphed_ms_per_token": round(t_graph, 3),
                      "verify_ms": {w: round(t, 3) for w, t in t_verify.items()}})
        lines += predictions(t_verify, t_draft, batch, "eager")
        lines += predictions(t_verify, t_graph, batch, "graphed")
        torch.cuda.empty_cache()
    for line in lines:
        print(json.dumps(line), flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
