"""CUDA-graph capture for the captured stepper (:class:`flashspec.resident.ResidentLoop`):
:func:`capture` records one function, :class:`GraphCache` replays a function per key from
static copies of its inputs, :class:`Prefill` is the prompt prefill of a static cache.

A graph's attention spans the whole static cache (positions, not a host-known length, mask
it), so a graph is valid for every step of every prompt as long as the cache object stays the
same. ``capture=False`` runs the very same static-buffer code eagerly: the CPU path of the
tests.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

from flashspec.models.llama import KVCache, LlamaLM

PREFILL_BUCKET = 64   # prompt windows are padded to a multiple of this many tokens (one graph each)


def bucketed(width: int, limit: int, bucket: int = PREFILL_BUCKET) -> int:
    """``width`` rounded up to a multiple of ``bucket`` tokens, at most ``limit``."""
    return min(-(-width // bucket) * bucket, limit)


def capture(run: Callable[[], Any], pool: Any = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(graph, outputs) of ``run`` after two eager warm-up runs on a side stream (they compute
    exactly what a replay will, so they are harmless); ``pool``: a memory pool shared with
    other graphs that never run at the same time."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # torch.cuda.graph collects garbage on entry; no collection may run inside the capture: a
    # collected graph of an earlier engine would free its memory pool mid-capture, which
    # invalidates the capture (seen on the H200 when engines of one process come and go)
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            outputs = run()
    finally:
        if collecting:
            gc.enable()
    torch.cuda.synchronize()
    return graph, outputs


@dataclass
class _GraphSlot:
    inputs: list[torch.Tensor]
    graph: torch.cuda.CUDAGraph | None = None
    outputs: Any = None


class GraphCache:
    """``fn(key, *inputs)`` replayed from one CUDA graph per key, on static copies of ``inputs``.

    The outputs are the graph's own buffers: read them before the next call with the same key
    (with a shared ``pool``: before the next call of any key).
    ``capture=False`` (CPU) runs ``fn`` eagerly on the static copies: the same code path.
    """

    def __init__(self, fn: Callable[..., Any], capture: bool, pool: Any = None) -> None:
        self.fn, self.capture, self.pool = fn, capture, pool
        self.slots: dict[Hashable, _GraphSlot] = {}
        self.capture_s = 0.0

    def __call__(self, key: Hashable, *inputs: torch.Tensor) -> Any:
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = _GraphSlot([x.clone() for x in inputs])
        else:
            for static, x in zip(slot.inputs, inputs):
                static.copy_(x, non_blocking=True)
        if not self.capture:
            return self.fn(key, *slot.inputs)
        if slot.graph is None:
            t0 = time.perf_counter()
            slot.graph, slot.outputs = capture(lambda: self.fn(key, *slot.inputs), self.pool)
            self.capture_s += time.perf_counter() - t0
        slot.graph.replay()
        return slot.outputs

    def prepare(self, key: Hashable, *inputs: torch.Tensor) -> None:
        """Record ``key``'s graph (as a first call does) unless it has one: ahead of a decode,
        so that no capture falls inside it; a key already recorded runs nothing."""
        if key not in self.slots:
            self(key, *inputs)

    def clear(self) -> None:
        """Drop every graph (their buffers point at state that is being replaced)."""
        self.slots.clear()


class Prefill:
    """The prompt prefill of a static cache, replayed from one CUDA graph per (batch, width
    bucket). Run eagerly, a prefill launches every kernel of every layer from Python, which for
    a small model costs as much as many replayed decode steps.

    The window is padded on the right to a multiple of ``bucket`` tokens. The padding's K/V
    land in cache slots past the prompt, which the decode steps rewrite before any query
    attends them (a query at position p sees slots <= p only, and a step writes its own slots
    first), as in the graphs' warm-up runs. The graphs share one memory pool (they never run
    at the same time) and each call returns a copy of its hidden states.
    """

    def __init__(self, target: LlamaLM, cache: KVCache, capture: bool,
                 bucket: int = PREFILL_BUCKET) -> None:
        self.target, self.cache, self.bucket = target, cache, bucket
        capture = capture and target.device.type == "cuda"
        self.graphs = GraphCache(self._run, capture,
                                 torch.cuda.graph_pool_handle() if capture else None)

    @property
    def capture_s(self) -> float:
        return self.graphs.capture_s

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [B, w, d] of the window ``tokens`` at ``positions`` [B, w]."""
        batch, width = tokens.shape
        padded = bucketed(width, self.cache.capacity, self.bucket)
        if padded > width:
            more = positions[:, -1:] + torch.arange(1, padded - width + 1, device=positions.device)
            positions = torch.cat([positions, more.clamp(max=self.cache.capacity - 1)], dim=1)
            tokens = torch.cat([tokens, tokens.new_zeros(batch, padded - width)], dim=1)
        return self.graphs((batch, padded), tokens, positions)[:, :width].clone()

    def _run(self, key: tuple[int, int], tokens: torch.Tensor, positions: torch.Tensor
             ) -> torch.Tensor:
        return self.target.forward_hidden(tokens, positions, self.cache, span=key[1])
