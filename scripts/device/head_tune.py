"""GPU diagnostic: the low-rank head's one-row up projection, Triton tile configs against cuBLAS.

    python3 scripts/device/head_tune.py [--shapes 1536x151936 4096x128256] [--ranks 8 16]

For each (d, V) and r = d/N: cuBLAS ``F.linear`` for the full head and for both low-rank
matmuls, and the Triton GEMV (flashspec.heads.triton_head) for the up projection at every tile
config in the grid, each timed in CUDA-graph replay over rotating weight copies (so a call
reads its weights from HBM, not from L2). Prints µs per call and ν against the full head;
picks nothing itself (default_config is changed by hand, with the numbers in the commit).
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton

from flashspec.heads import triton_head as th


def graph_time(fn_for_copy, copies: int, rounds: int = 10, replays: int = 20) -> float:
    """µs per call: one graph of rounds x copies calls (copy i's weights each time), replayed."""
    for i in range(copies):
        fn_for_copy(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(rounds):
            for i in range(copies):
                fn_for_copy(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * rounds * copies)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["1536x151936"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[8, 16])
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    for shape in args.shapes:
        d, v = (int(x) for x in shape.split("x"))
        l2 = torch.cuda.get_device_properties(dev).L2_cache_size
        full_copies = max(2, -(-2 * l2 // (v * d * 2)) + 1)
        h = torch.randn(1, d, device=dev, dtype=dt)
        fw = [torch.randn(v, d, device=dev, dtype=dt) * 0.02 for _ in range(full_copies)]
        full = graph_time(lambda i: F.linear(h, fw[i]), full_copies)
        del fw
        print(f"d={d} V={v}: full head {full:.1f} us ({full_copies} copies)")
        for div in args.ranks:
            r = d // div
            copies = max(2, -(-2 * l2 // (v * r * 2)) + 1)
            down = [torch.randn(r, d, device=dev, dtype=dt) * 0.05 for _ in range(copies)]
            up = [torch.randn(v, r, device=dev, dtype=dt) * 0.05 for _ in range(copies)]
            u = F.linear(h, down[0])
            ref = F.linear(u, up[0]).float()
            cub_up = graph_time(lambda i: F.linear(u, up[i]), copies)
            cub_both = graph_time(lambda i: F.linear(F.linear(h, down[i]), up[i]), copies)
            print(f"  r=d/{div}={r}: cuBLAS up {cub_up:.1f} us, down+up {cub_both:.1f} us "
                  f"(nu {cub_both / full:.3f}); floor up {v * r * 2 / 3.35e6:.1f} us at 3.35 TB/s")
            rows = []
            for bn, bk, warps, stages in itertools.product(
                    (32, 64, 128, 256), (64, 128, 256), (2, 4, 8), (1,)):
                if bk > max(16, triton.next_power_of_2(r)) or bn * bk > 32768:
                    continue
                cfg = th.Config(bn, bk, warps, stages)
                try:
                    got = th.skinny_matmul(u, up[0], cfg).float()
                    if not torch.allclose(got, ref, rtol=2e-2, atol=2e-2):
                        rows.append((float("inf"), cfg, "WRONG"))
                        continue
                    t = graph_time(lambda i: th.skinny_matmul(u, up[i], cfg), copies)
                    rows.append((t, cfg, ""))
                except Exception as exc:  # a config the compiler refuses is reported, not fatal
                    rows.append((float("inf"), cfg, type(exc).__name__))
            rows.sort(key=lambda x: x[0])
            default = th.default_config(1, r)
            dt_default = next((t for t, c, _ in rows if c == default), float("nan"))
            print(f"    triton default {default}: {dt_default:.1f} us")
            for t, cfg, note in rows[:8]:
                both = graph_time(lambda i: th.skinny_matmul(F.linear(h, down[i]), up[i], cfg), copies)
                print(f"    {cfg}: up {t:.1f} us, down+up {both:.1f} us (nu {both / full:.3f}) {note}")
            bad = [f"{c} {n}" for t, c, n in rows if n]
            if bad:
                print(f"    refused or wrong: {len(bad)}: {bad[:4]}")
            del down, up


if __name__ == "__main__":
    main()
