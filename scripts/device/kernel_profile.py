"""Where the fused verify's time goes on a GPU: per-kernel µs for several launch geometries.

Each kernel of a verify call (stats, decide, race, finish) is timed alone with CUDA events,
the L2 flushed before every launch (so no kernel reads logits another left in cache), next to
two bandwidth references: torch's ``amax`` over the same logits and a Triton kernel that only
sums them in pass 1's geometry (``read_us``: what pass 1 would take with no softmax work).
The flush *reads* a 256 MB buffer (``--flush read``, the default): a flush that writes it
(``--flush write``, sessions 5-6) leaves ~50 MB of dirty lines in the L2, whose write-back
then competes with the timed kernel's reads. Whole calls are timed too (one
event pair around all launches, flushed first). Every geometry's tokens are checked against the
reference. GPU only.

    python scripts/device/kernel_profile.py --out DIR [--shapes 64,4,128256 ...] [--quick | --default-only]
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from experiments.kernel_bench import bytes_min, make_inputs
from flashspec.core import SamplingParams
from flashspec.verify import reference
from flashspec.verify import triton_backend as tb

FLUSH = 256 << 20      # bytes touched between launches: several times the H200's 60 MB L2
FLUSH_MODE = "read"


def _flush(buf: torch.Tensor) -> None:
    if FLUSH_MODE == "read":
        buf.sum()
    else:
        buf.zero_()


@triton.jit
def _read_kernel(p, q, out, V, G: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Sum of one chunk of p (and q for positions < G): pass 1's reads without its math."""
    c, b, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pr = p + (b * (G + 1) + j).to(tl.int64) * V
    qr = q + (b * G + tl.minimum(j, G - 1)).to(tl.int64) * V
    acc = tl.zeros([BLOCK], tl.float32)
    for t in tl.static_range(0, CHUNK, BLOCK):
        offs = c * CHUNK + t + tl.arange(0, BLOCK)
        m = offs < V
        acc += tl.load(pr + offs, mask=m, other=0.0).to(tl.float32)
        acc += tl.load(qr + offs, mask=m & ((offs * 0 + j) < G), other=0.0).to(tl.float32)
    tl.store(out + (b * (G + 1) + j) * tl.num_programs(0) + c, tl.sum(acc, 0))


def read_only(x: torch.Tensor, q: torch.Tensor, chunk: int, block: int, warps: int):
    """A launcher of ``_read_kernel`` over x [B, G+1, V] and q [B, G, V]."""
    b, g1, v = x.shape
    nc = -(-v // chunk)
    out = torch.empty(b * g1 * nc, dtype=torch.float32, device=x.device)
    return lambda: _read_kernel[(nc, b, g1)](x, q, out, v, G=g1 - 1, CHUNK=chunk, BLOCK=block,
                                              num_warps=warps)


def timed(fn, flush: torch.Tensor, iters: int) -> float:
    """Median µs of ``fn`` over ``iters`` launches, each after an L2 flush."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        _flush(flush)
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
    return [tb.Plan(1, 8192, rc, 4, rw, fused=False)
            for rc, rw in itertools.product((1024, 2048, 4096, 8192), (4, 8))]


def geometries(quick: bool) -> list[tb.Plan]:
    """Pass-1 geometries (chunk size, warps), then the race's (the default plan is added per
    shape)."""
    chunks = (4096, 8192) if quick else (2048, 4096, 8192, 16384)
    plans = [tb.Plan(1, c, 4096, w, 4, fused=False)
             for c, w in itertools.product(chunks, (4, 8))]
    return plans + race_geometries()


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
    reads = {f"read_us_c{c}_b{bl}_w{w}": timed(read_only(x, q, c, bl, w), flush, iters)
             for c, bl, w in ((8192, 1024, 4), (8192, 2048, 8), (16384, 4096, 8))}
    log({"shape": shape, "flush": FLUSH_MODE, "floor_us": floor, "torch_amax_us": amax,
         "amax_floor_ratio": amax / floor, **reads})
    for p in [tb.plan(b, g, v)] + plans:
        got = tb.launch(x, tok, q, params, 7, geometry=p)
        same = all(torch.equal(r, o) for r, o in zip(ref, got))
        key = next(k for k in tb._SLOTS if k[1:4] == (b, g, v) and k[-2] == p)
        slot = tb._SLOTS[key]
        args = (x, x.stride(0), q, q.stride(0), tok, x, 1.0, *tb.seed_args(7, dev), slot.ws)
        tail = (torch.empty(b * (g + 2), dtype=torch.int64, device=dev), b, v)
        kern = per_kernel(slot, args, tail, flush, iters)
        whole = timed(lambda: tb.launch(x, tok, q, params, 7, geometry=p), flush, iters)
        log({"shape": shape, "flush": FLUSH_MODE, "plan": p.__dict__, "same": same, "whole_us": whole,
             "floor_ratio": whole / floor, **{f"{k}_us": t for k, t in kern.items()}})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", nargs="*", default=["64,4,128256", "64,8,128256"])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="a smaller geometry sweep")
    ap.add_argument("--default-only", action="store_true", help="only the default plan")
    ap.add_argument("--race-only", action="store_true", help="sweep pass-2 geometries only")
    ap.add_argument("--plans", default="", help="JSON list of Plan fields: these plans only")
    ap.add_argument("--flush", choices=("read", "write"), default="read",
                    help="L2 flush between launches: read (clean lines) or write (dirty)")
    a = ap.parse_args()
    global FLUSH_MODE
    FLUSH_MODE = a.flush
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
            if a.plans:
                plans = [tb.Plan(**d) for d in json.loads(a.plans)]
            profile_shape(tuple(int(t) for t in s.split(",")), plans, a.iters, flush, log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
