"""Where the fused verify's time goes on a GPU: per-kernel µs for several launch geometries.

Each kernel of a verify call (stats, decide, race, finish) is timed alone with CUDA events,
the L2 flushed before every launch (so no kernel reads logits another left in cache), next to
a bandwidth reference: torch's ``amax`` over the same logits. Whole calls are timed too (one
event pair around all launches, flushed first). Every geometry's tokens are checked against the
reference. GPU only.

    python scripts/kernel_profile.py --out DIR [--shapes 64,4,128256 ...] [--quick | --default-only]
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments.kernel_bench import bytes_min, make_inputs  # noqa: E402
from flashspec.verify import SamplingParams, reference  # noqa: E402
from flashspec.verify import triton_backend as tb  # noqa: E402

FLUSH = 256 << 20      # bytes written between launches: several times the H200's 60 MB L2


def timed(fn, flush: torch.Tensor, iters: int) -> float:
    """Median µs of ``fn`` over ``iters`` launches, each after an L2 flush."""
    fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        torch.cuda._sleep(200_000)       # ~0.1 ms: the host enqueues the launches meanwhile
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def per_kernel(slot: tb._Slot, args: tuple, tail: tuple, flush: torch.Tensor, iters: int
               ) -> dict[str, float]:
    """µs of every launch of a cached slot, each alone (after one full call set the state)."""
    out = {}
    for name, fn, grid, consts, warps in slot.launches:
        full = tb.launch_args(slot, name, args, tail)
        out[name] = timed(lambda: fn[grid](*full, **consts, num_warps=warps), flush, iters)
    return out


def race_geometries() -> list[tb.Plan]:
    """Pass-2 (race) geometries at the default pass-1 geometry of large batches."""
    return [tb.Plan(1, 8192, 1024, rc, rb, 4, rw, fused=False)
            for rc, rb, rw in itertools.product((1024, 2048, 4096, 8192), (256, 512, 1024), (4, 8))
            if rb <= rc]


def geometries(quick: bool) -> list[tb.Plan]:
    """Launch geometries to compare (the default plan is added per shape)."""
    chunks = (4096, 8192, 16384) if quick else (2048, 4096, 8192, 16384)
    blocks = (1024, 2048)
    warps = (4, 8)
    rchunks = (2048, 8192) if quick else (1024, 2048, 4096, 8192)
    plans = [tb.Plan(1, c, b, 8192, 512, w, 4, fused=False)
             for c, b, w in itertools.product(chunks, blocks, warps) if b <= c]
    plans += [tb.Plan(1, 8192, 1024, rc, rb, 4, rw, fused=False)
              for rc, rb, rw in itertools.product(rchunks, (512, 1024, 2048), (4, 8))
              if rb <= rc]
    return plans


def profile_shape(shape: tuple[int, int, int], plans: list[tb.Plan], iters: int,
                  flush: torch.Tensor, log) -> None:
    b, g, v = shape
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x, tok, q = make_inputs(b, g, v, torch.bfloat16, "full", 1.0, dev, gen)
    params = SamplingParams(temperature=1.0)
    floor = bytes_min(b, g, v, torch.bfloat16, "full") / 4.8e12 * 1e6
    amax = timed(lambda: (x.amax(-1), q.amax(-1)), flush, iters)
    ref = reference.verify(x, tok, q, params, 7)
    log({"shape": shape, "floor_us": floor, "torch_amax_us": amax,
         "amax_floor_ratio": amax / floor})
    for p in [tb.plan(b, g, v)] + plans:
        got = tb.launch(x, tok, q, params, 7, geometry=p)
        same = all(torch.equal(r, o) for r, o in zip(ref, got))
        key = next(k for k in tb._SLOTS if k[1:4] == (b, g, v) and k[-2] == p)
        slot = tb._SLOTS[key]
        args = (x, x.stride(0), q, q.stride(0), tok, x, 1.0, *tb._seed_args(7, dev), slot.ws)
        tail = (torch.empty(b * (g + 2), dtype=torch.int64, device=dev), b, v)
        kern = per_kernel(slot, args, tail, flush, iters)
        whole = timed(lambda: tb.launch(x, tok, q, params, 7, geometry=p), flush, iters)
        log({"shape": shape, "plan": p.__dict__, "same": same, "whole_us": whole,
             "floor_ratio": whole / floor, **{f"{k}_us": t for k, t in kern.items()}})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", nargs="*", default=["64,4,128256", "64,8,128256"])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="a smaller geometry sweep")
    ap.add_argument("--default-only", action="store_true", help="only the default plan")
    ap.add_argument("--race-only", action="store_true", help="sweep pass-2 geometries only")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    flush = torch.empty(FLUSH // 4, dtype=torch.float32, device="cuda")
    with open(a.out / "kernel_profile.jsonl", "w") as fh:
        def log(rec: dict) -> None:
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            print(json.dumps(rec), flush=True)
        for s in a.shapes:
            plans = ([] if a.default_only else race_geometries() if a.race_only
                     else geometries(a.quick))
            profile_shape(tuple(int(t) for t in s.split(",")), plans, a.iters, flush, log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
