"""CUDA: time the low-rank head's up projection y = u W_up^T [N = V, K = r], cuBLAS (F.linear)
vs Triton tile configs, at the shapes that matter (Llama-3.1-8B r = d/8 and d/32, SmolLM2
r = d/8), after the down projection h W_down^T [N = r, K = d] (cuBLAS vs the default tile).

Each timing replays a CUDA graph of calls that rotate through enough W_up copies to exceed
2x the L2 cache (cold weights, no launch gaps), median of several replays. Writes one JSON
line per (case, implementation) to OUT/sweep.jsonl and a table to stdout.
Usage: ``python3 scripts/device/head_triton_sweep.py --out DIR [--budget-s 30]``.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from flashspec.heads import triton_head as th

CASES = ((128256, 512, 1), (128256, 128, 1), (128256, 512, 16), (49152, 72, 1), (128256, 512, 4))
# the down projection h W_down^T (N = r, K = d): what cuBLAS costs there (Triton: default only)
DOWN_CASES = ((512, 4096, 1), (128, 4096, 1), (72, 576, 1))


def configs(rows: int, k: int) -> list[th.Config]:
    """The default first, then a small grid around it."""
    grid = [th.default_config(rows, k)]
    if rows == 1:
        bk = grid[0].block_k
        for bn, warps in ((16, 4), (32, 4), (64, 4), (128, 4), (32, 8), (64, 8)):
            grid.append(th.Config(bn, bk, warps, 2))
        grid.append(th.Config(64, min(bk, 128), 4, 3))
    else:
        for bn, bk, warps, stages in ((32, 128, 4, 3), (128, 128, 4, 3), (64, 64, 4, 4),
                                      (64, 256, 8, 3), (128, 64, 4, 4)):
            grid.append(th.Config(bn, min(bk, max(16, th.triton.next_power_of_2(k))), warps,
                                  stages))
    return list(dict.fromkeys(grid))


def time_us(fn: Callable[[int], torch.Tensor], n_copies: int, reps: int = 15) -> float:
    """Median microseconds per call over graph replays of calls rotating the weight copies."""
    inner = max(8, n_copies)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(2):
            fn(i % n_copies)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(inner):
            fn(i % n_copies)
    graph.replay()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / inner)
    return statistics.median(samples)


def run_case(n: int, k: int, rows: int, deadline: float, out, grid: bool = True) -> None:
    """Time cuBLAS and the Triton configs (``grid``: all, else the default) for one
    (N, K, rows); write and print records."""
    l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))
    g = torch.Generator("cuda").manual_seed(0)
    w0 = torch.randn(n, k, generator=g, device="cuda").bfloat16()
    copies = [w0] + [w0.clone() for _ in range(math.ceil(2 * l2 / (w0.numel() * 2)) - 1)]
    u = torch.randn(rows, k, generator=g, device="cuda").bfloat16()
    ref = F.linear(u.float(), w0.float())
    base = {"n": n, "k": k, "batch": rows, "dtype": "bfloat16", "copies": len(copies),
            "weight_mb": w0.numel() * 2 / 1e6, "gpu": torch.cuda.get_device_name(0)}
    with torch.inference_mode():
        rec = {**base, "impl": "cublas", "latency_us": time_us(lambda i: F.linear(u, copies[i]),
                                                             len(copies))}
        _emit(rec, out)
        for cfg in configs(rows, k) if grid else [th.default_config(rows, k)]:
            if time.perf_counter() > deadline:
                print("sweep budget spent", file=sys.stderr)
                return
            try:
                err = (th.skinny_matmul(u, w0, cfg).float() - ref).abs().max().item()
                t = time_us(lambda i, c=cfg: th.skinny_matmul(u, copies[i], c), len(copies))
                rec = {**base, "impl": "triton", "config": vars(cfg), "latency_us": t,
                       "max_abs_err": err, "default": cfg == th.default_config(rows, k)}
            except Exception as e:  # a config that fails to compile is a result, not a stop
                rec = {**base, "impl": "triton", "config": vars(cfg), "error": repr(e)[:300]}
            _emit(rec, out)


def _emit(rec: dict, out) -> None:
    out.write(json.dumps(rec) + "\n")
    out.flush()
    gbs = rec["weight_mb"] * 1e-3 / (rec["latency_us"] * 1e-6) if "latency_us" in rec else 0
    print(f"N={rec['n']} K={rec['k']} B={rec['batch']} {rec['impl']:7s} "
          f"{rec.get('config', '')} {rec.get('latency_us', float('nan')):8.2f} us "
          f"{gbs:7.0f} GB/s {rec.get('error', '')}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=30.0)
    a = p.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + a.budget_s
    with open(Path(a.out) / "sweep.jsonl", "a") as out:
        for n, k, rows in DOWN_CASES:
            run_case(n, k, rows, deadline, out, grid=False)
        for n, k, rows in CASES:
            if time.perf_counter() > deadline:
                break
            run_case(n, k, rows, deadline, out)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
