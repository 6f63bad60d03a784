"""CUDA graphs of the decode steps: the target's verify step (forward, head and fused verify in
one replay) and, through :class:`GraphCache`, a drafter's whole γ-token drafting.

One graph per (batch, width, full q or one-hot): the step's inputs are copied into static
buffers, the graph is replayed, and the engine reads the emitted tokens and counts once. The
attention spans the whole static cache (positions, not a host-known length, mask it), so a
graph is valid for every step of every prompt as long as the cache object stays the same.
Graphs are captured lazily, at the first step of a new shape, after two eager warm-up runs on
a side stream (they compute exactly what the replay will, so they are harmless).

``capture=False`` runs the very same static-buffer step eagerly: the CPU path of the tests.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

from flashspec.core import SamplingParams
from flashspec.models.llama import KVCache, LlamaLM
from flashspec.verify.api import Backend

PREFILL_BUCKET = 64   # prompt windows are padded to a multiple of this many tokens (one graph each)


def bucketed(width: int, limit: int, bucket: int = PREFILL_BUCKET) -> int:
    """``width`` rounded up to a multiple of ``bucket`` tokens, at most ``limit``."""
    return min(-(-width // bucket) * bucket, limit)


@dataclass
class _Slot:
    """Static inputs and outputs of one captured shape."""

    tokens: torch.Tensor            # [B, w] int64
    positions: torch.Tensor         # [B, w] int64
    drafts: torch.Tensor            # [B, w - 1] int64
    draft_logits: torch.Tensor | None
    seed: torch.Tensor              # [] int64
    graph: torch.cuda.CUDAGraph | None = None
    hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    out: torch.Tensor | None = None
    n_acc: torch.Tensor | None = None


class GraphedStep:
    """``step(tokens, positions, drafts, draft_logits, seed)`` of the target, replayed as a graph."""

    def __init__(self, target: LlamaLM, cache: KVCache, backend: Backend, params: SamplingParams,
                 capture: bool = True, compile: bool = False) -> None:
        self.target, self.cache, self.verify, self.params = target, cache, backend.verify, params
        self.fuse_verify = backend.fuses_in_graph(params)   # verify inside the captured graph
        # torch.compile fuses the many small element-wise kernels of a step (norms, RoPE, SiLU);
        # one compile with a symbolic width serves every captured shape
        self.forward = torch.compile(self._forward, dynamic=True) if compile else self._forward
        self.capture = capture and target.device.type == "cuda"
        self.slots: dict[tuple[int, int, int], _Slot] = {}
        self.capture_s = 0.0

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, drafts: torch.Tensor,
                 draft_logits: torch.Tensor | None, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden [B, w, d], out [B, w] padded with -1, n_accepted [B]) of one verify step."""
        slot = self._slot(tokens.shape, None if draft_logits is None else draft_logits.shape)
        slot.tokens.copy_(tokens, non_blocking=True)
        slot.positions.copy_(positions, non_blocking=True)
        slot.drafts.copy_(drafts, non_blocking=True)
        if draft_logits is not None:
            slot.draft_logits.copy_(draft_logits, non_blocking=True)
        slot.seed.fill_(seed)
        if slot.graph is None and self.capture:
            self._capture(slot)
        if slot.graph is not None:
            slot.graph.replay()
        else:
            self._run(slot)
        if not self.fuse_verify:
            slot.out, slot.n_acc = self.verify(slot.logits, slot.drafts, slot.draft_logits,
                                               self.params, int(seed))
        return slot.hidden, slot.out, slot.n_acc

    def prepare(self, batch: int, widths: dict[int, bool]) -> None:
        """Capture every (width, full-q?) step shape up front (the cold start).

        The warm-up writes K/V of dummy tokens at slots 0..w-1; those slots are rewritten by
        the real prompt before any query can attend them (a query at p sees slots <= p only).
        Without capture (CPU) there is nothing to prepare: slots are made at first use.
        """
        if not self.capture:
            return
        vocab = self.target.shape.vocab_size
        for width, with_q in sorted(widths.items()):
            for q in {False, with_q and width > 1}:
                pos = torch.arange(width, device=self.target.device).expand(batch, width)
                drafts = torch.zeros(batch, width - 1, dtype=torch.long, device=self.target.device)
                logits = (torch.zeros(batch, width - 1, vocab, dtype=self.target.dtype,
                                      device=self.target.device) if q else None)
                self(pos, pos, drafts, logits, 0)

    def _slot(self, shape: torch.Size, q_shape: torch.Size | None) -> _Slot:
        key = (shape[0], shape[1], q_shape is not None)
        if key not in self.slots:
            dev = self.target.device
            batch, width = shape
            q = None if q_shape is None else torch.zeros(q_shape, dtype=self.target.dtype, device=dev)
            self.slots[key] = _Slot(
                tokens=torch.zeros(batch, width, dtype=torch.long, device=dev),
                positions=torch.zeros(batch, width, dtype=torch.long, device=dev),
                drafts=torch.zeros(batch, width - 1, dtype=torch.long, device=dev),
                draft_logits=q, seed=torch.zeros((), dtype=torch.long, device=dev))
        return self.slots[key]

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.target.forward_hidden(tokens, positions, self.cache)
        return hidden, self.target.logits(hidden)

    def _run(self, slot: _Slot) -> None:
        """The step itself, on static buffers (what a graph records)."""
        slot.hidden, slot.logits = self.forward(slot.tokens, slot.positions)
        if self.fuse_verify:
            slot.out, slot.n_acc = self.verify(slot.logits, slot.drafts, slot.draft_logits,
                                               self.params, slot.seed)

    def _capture(self, slot: _Slot) -> None:
        t0 = time.perf_counter()
        slot.graph, _ = capture(lambda: self._run(slot))
        self.capture_s += time.perf_counter() - t0


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
