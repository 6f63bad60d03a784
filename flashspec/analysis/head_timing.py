"""One head's latency in this process: what SlimSpec's ν and κ are measured from.

On CUDA the head is timed inside a CUDA graph (SlimSpec's ν is a kernel-time ratio; a host
timer around one call adds launch and synchronisation latency of the same order as a low-rank
head's whole kernel time, so it would measure the host, not the head).
Each timed call is preceded by a write of a buffer larger than L2, so the head reads its weights
from HBM as it does in a decode step, where the layers between two head calls evict them; the
flush's own time (a graph of flushes alone) is subtracted. Elsewhere a host timer per call.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from flashspec.graphs import capture

_FLUSH_BYTES = 256 << 20            # above the L2 of every current GPU


def head_latency(head: torch.nn.Module, hidden: int, device: torch.device, dtype: torch.dtype,
                 iters: int, warmup: int = 5, graph: bool | None = None) -> float:
    """Median seconds of one head call on a single hidden vector (B = 1).

    ``graph`` (default: on CUDA) times the call in a CUDA graph with the L2 flushed first."""
    h = torch.randn(1, hidden, device=device, dtype=dtype)
    with torch.inference_mode():
        if graph if graph is not None else device.type == "cuda":
            return _graph_latency(head, h, iters)
        times = []
        for i in range(iters + warmup):
            t0 = time.perf_counter()
            head(h)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def _graph_latency(head: torch.nn.Module, h: torch.Tensor, iters: int, calls: int = 16) -> float:
    flush = torch.empty(_FLUSH_BYTES // 4, device=h.device, dtype=torch.float32)

    def run(with_head: bool) -> Callable[[], None]:
        def go() -> None:
            for _ in range(calls):
                flush.fill_(1.0)
                if with_head:
                    head(h)
        return go

    # the runner's capture: warm-up runs (autotuning, lazy init) on a side stream first
    (both, _), (alone, _) = capture(run(True)), capture(run(False))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def per_call(g: torch.cuda.CUDAGraph) -> float:
        out = []
        for _ in range(max(3, iters // calls)):
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3 / calls)
        return statistics.median(out)

    per_call(both), per_call(alone)               # first replays upload the graphs
    return max(per_call(both) - per_call(alone), 0.0)
