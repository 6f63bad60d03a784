"""One head's latency in this process: what SlimSpec's ν and κ are measured from."""
from __future__ import annotations

import statistics
import time

import torch


def head_latency(head: torch.nn.Module, hidden: int, device: torch.device, dtype: torch.dtype,
                 iters: int, warmup: int = 5) -> float:
    """Median seconds of one head call on a single hidden vector (B = 1)."""
    h = torch.randn(1, hidden, device=device, dtype=dtype)
    times = []
    with torch.inference_mode():
        for i in range(iters + warmup):
            t0 = time.perf_counter()
            head(h)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)
