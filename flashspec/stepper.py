"""Steppers: what the one decode driver (:meth:`flashspec.engine.SpecEngine.generate`) runs.

A stepper holds the decode state of one batch over one target cache: ``load`` the prompts
(prefill, drafters started, fresh counters), ``launch(arm, n)`` n draft → verify → commit steps
of an arm (:class:`flashspec.core.Arm`), ``snapshot`` the per-row counters (:data:`COUNTERS`),
read the committed ``tokens()`` and the acceptance ``histogram()`` at the end.
:func:`run_chunks` drives one in chunks; policy, planner, rewards and records see nothing but
the counters, so they see the same facts under every stepper.

Two implement it. :class:`ReferenceStepper` (here) is the readable oracle: lengths, budgets,
flags and counters in host lists, each step's result read back and committed in plain Python,
seeds from :func:`flashspec.verify.rng.call_seed`. :class:`flashspec.resident.ResidentLoop` is
the captured one: the same step as device ops on device-resident state, each arm's step
replayed from CUDA graphs in chunks, drafting ahead of the host's reads. Both draft through
the one drafter protocol (:class:`flashspec.drafters.Drafter`, device tensors), so the
captured stepper's commit and seed derivation are checked against this one
(tests/test_resident.py).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from flashspec.core import Arm, SamplingParams
from flashspec.drafters.base import Drafter, does
from flashspec.models.llama import KVCache, LlamaLM
from flashspec.tree import compact_path, tree_attention
from flashspec.verify.api import Backend
from flashspec.verify.rng import call_seed

COUNTERS = ("steps", "proposed", "accepted", "full", "lengths", "budgets", "finished", "bad")
DRAFT_STREAM = 0x5BD1E995    # xor-ed into a step's verify seed: the drafter's own random stream


@dataclass
class Snapshot:
    """Counters after a chunk (``host``: [len(COUNTERS), B], pinned memory for a captured
    stepper); ``wait`` blocks until they landed. ``tokens``: the token buffer copied with them
    (a captured stepper whose ``copy_tokens`` is set), so that host facts about a chunk the
    host has read need no device read, which would wait for the chunk in flight."""

    host: torch.Tensor
    tag: object            # the decision the chunk ran under
    n_steps: int
    start: torch.cuda.Event | float | None
    end: torch.cuda.Event | float | None
    launched: int = 0        # steps launched up to and including this chunk
    tokens: torch.Tensor | None = None

    def wait(self) -> dict[str, list[int]]:
        if isinstance(self.end, torch.cuda.Event):
            self.end.synchronize()
        return {k: row for k, row in zip(COUNTERS, self.host.tolist())}

    def seconds(self) -> float:
        if isinstance(self.end, torch.cuda.Event):
            return self.start.elapsed_time(self.end) / 1000.0
        return float(self.end - self.start)


class Stepper(Protocol):
    """The decode state of one batch, stepped by arms (see the module docstring)."""

    capture: bool              # the device runs ahead of the host (run_chunks overlaps)
    capture_s: float           # CUDA-graph capture time so far
    copy_tokens: bool          # snapshots carry the token buffer (a policy reads host facts)

    def prepare(self, arms: Sequence[Arm]) -> None: ...     # every step it may launch, ahead

    def load(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, seed: int,
             calls: int) -> None: ...

    def launch(self, arm: Arm, n_steps: int) -> None: ...

    def draft_ahead(self, arm: Arm) -> None: ...

    def mark(self) -> torch.cuda.Event | float: ...

    def snapshot(self, tag: object, n_steps: int, start: torch.cuda.Event | float
                 ) -> Snapshot: ...

    def tokens(self) -> list[list[int]]: ...

    def host_tokens(self, snapshot: Snapshot | None = None) -> list[list[int]]: ...
    # committed tokens (host facts read them): as of ``snapshot`` where it carries them

    def histogram(self) -> list[list[int]]: ...

    @property
    def calls(self) -> int: ...


class Lag:
    """How far behind each drafter's fixed drafting window (the last γ + 1 committed tokens)
    falls. A step of γ commits at most γ + 1 tokens per row (a tree of depth D: D + 1; a plain
    step: 1), which the same drafter's next window covers; a drafter that did not draft a step
    falls behind by that many, and is caught up before it drafts again."""

    def __init__(self, drafters: Sequence[Drafter]) -> None:
        self.behind = {d.name: 0 for d in drafters}

    def reset(self) -> None:
        self.behind = dict.fromkeys(self.behind, 0)

    def width(self, arm: Arm, top: int) -> int | None:
        """The catch-up window ``arm``'s drafter needs before it drafts (None: none)."""
        if arm.drafts and self.behind.get(arm.drafter, 0) > arm.gamma + 1:
            return catch_up_width(self.behind[arm.drafter], top)
        return None

    def account(self, arm: Arm, n_steps: int) -> None:
        """``n_steps`` steps of ``arm`` launched."""
        for name in self.behind:
            self.behind[name] = (arm.gamma + 1 if name == arm.drafter
                                 else self.behind[name] + n_steps * (arm.gamma + 1))


def catch_up_width(behind: int, top: int) -> int:
    """The catch-up window of a drafter ``behind`` tokens behind (> γ + 1 >= 2): the next power
    of two, at most the ``top`` committed tokens a row can hold (one graph per width)."""
    return min(1 << (behind - 1).bit_length(), top)


def catch_up_widths(top: int) -> list[int]:
    """Every width :func:`catch_up_width` gives (``behind`` from 3 up)."""
    return sorted({catch_up_width(b, top) for b in (1 << k for k in range(2, top.bit_length() + 1))})


class ReferenceStepper:
    """The reference stepper: every step from Python, its result read back and committed in
    host lists (tokens, lengths, budgets, finished flags, counters). The target attends only
    the ``span`` the host lengths give, so a CPU run costs what the prompts need."""

    capture = False
    capture_s = 0.0
    copy_tokens = False         # every chunk is read before the next: the rows are current

    def __init__(self, target: LlamaLM, cache: KVCache, backend: Backend, params: SamplingParams,
                 eos_ids: Sequence[int], batch: int, gamma_max: int,
                 drafters: Sequence[Drafter] = ()) -> None:
        self.target, self.cache, self.backend, self.params = target, cache, backend, params
        self.eos = set(eos_ids)
        self.gamma_max = gamma_max
        self.drafters = list(drafters)
        self.drafter_of = {d.name: d for d in self.drafters}
        self.lag = Lag(self.drafters)

    def prepare(self, arms: Sequence[Arm]) -> None:
        """Nothing to capture."""

    # ------------------------------------------------------------------ a batch
    def load(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, seed: int,
             calls: int) -> None:
        """Prefill the prompts (all but each row's last token), start the drafters on them."""
        batch, dev = len(prompts), self.target.device
        self.rows = [list(p) for p in prompts]
        self.lengths = [len(p) for p in prompts]
        self.budgets = [max_new_tokens] * batch
        self.finished, self.bad = [False] * batch, [False] * batch
        self.count = {k: [0] * batch for k in ("steps", "proposed", "accepted", "full")}
        self.hist = [[0] * (self.gamma_max + 1) for _ in range(batch)]
        self.seed, self._calls = seed, calls
        self.buffer = torch.zeros(batch, self.cache.capacity + 1, dtype=torch.long)
        for b, p in enumerate(prompts):
            self.buffer[b, :len(p)] = torch.tensor(p)
        self.buffer = self.buffer.to(dev)
        width = max(self.lengths)
        positions = torch.arange(width, device=dev).expand(batch, width)
        hidden = (self.target.forward_hidden(self.buffer[:, :width - 1],
                                             positions[:, :width - 1], self.cache, span=width - 1)
                  if width > 1 else torch.zeros(batch, 0, self.target.shape.hidden_size,
                                                dtype=self.target.dtype, device=dev))
        # A drafter starts on the prompts when an arm of it first drafts (launch): a policy that
        # never plays an arm on a batch does not pay that drafter's prefill. Until then it falls
        # behind like any drafter that does not draft, and the catch-up covers the steps since.
        self.unstarted = {d.name: (self.buffer[:, :width].clone(),
                                   torch.tensor(self.lengths, device=dev), hidden)
                          for d in self.drafters if does(d, "start")}
        self.lag.reset()

    @property
    def calls(self) -> int:
        return self._calls

    def host_tokens(self, snapshot: Snapshot | None = None) -> list[list[int]]:
        """Every row's committed tokens as they stand (what host facts read; no chunk is in
        flight when the host reads them, so the snapshot adds nothing)."""
        return self.rows

    # ------------------------------------------------------------------ steps
    def launch(self, arm: Arm, n_steps: int) -> None:
        if arm.drafts and arm.drafter in self.unstarted:
            self.drafter_of[arm.drafter].start(*self.unstarted.pop(arm.drafter))
        width = self.lag.width(arm, self.buffer.shape[1] - 1)
        if width is not None:
            self.drafter_of[arm.drafter].catch_up(self.buffer, self._lengths(), width)
        self.lag.account(arm, n_steps)
        for _ in range(n_steps):
            self.step(arm)

    def draft_ahead(self, arm: Arm) -> None:
        raise NotImplementedError("the reference stepper reads every chunk before the next")

    def _lengths(self) -> torch.Tensor:
        return torch.tensor(self.lengths, device=self.buffer.device)

    def step(self, arm: Arm) -> None:
        """Draft, score [last token, drafts] (or the tree), verify, commit."""
        seed = call_seed(self.seed, self._calls)
        self._calls += 1
        draft_seed = torch.tensor(seed ^ DRAFT_STREAM, device=self.buffer.device)
        lengths, span = self._lengths(), max(self.lengths)
        drafter = self.drafter_of.get(arm.drafter)
        if arm.tree is not None:
            tree = drafter.draft_tree(self.buffer, lengths, arm.tree, self.params, draft_seed)
            positions, attention = tree_attention(tree, lengths, span + tree.size)
            hidden = self.target.forward_hidden(tree.tokens, positions, self.cache,
                                                span=span + tree.size, tree=attention)
            out, n_acc, path = self.backend.verify_tree(self.target.logits(hidden), tree,
                                                        self.params, seed, depth=arm.gamma)
            hidden = compact_path(self.cache, hidden, path, lengths)
            offered = [arm.gamma] * len(self.rows)
        else:
            if arm.drafts:
                drafts, q, real = drafter.draft(self.buffer, lengths, arm.gamma, self.params,
                                                draft_seed)
            else:
                drafts, q, real = lengths.new_zeros(len(self.rows), 0), None, None
            last = self.buffer.gather(1, (lengths - 1)[:, None])
            positions = (lengths - 1)[:, None] + torch.arange(arm.gamma + 1, device=lengths.device)
            hidden = self.target.forward_hidden(torch.cat([last, drafts], 1), positions,
                                                self.cache, span=span + arm.gamma)
            out, n_acc = self.backend.verify(self.target.logits(hidden), drafts, q, self.params,
                                             seed)
            offered = real.tolist() if real is not None else [arm.gamma] * len(self.rows)
        for d in self.drafters:      # also those that did not draft: a later catch-up reads them
            d.absorb(hidden, lengths)
        host = torch.cat([out, n_acc[:, None].to(out.dtype)], 1).tolist()   # the one host read
        self.commit([r[:-1] for r in host], [int(r[-1]) for r in host], offered)

    def commit(self, out: list[list[int]], n_acc: list[int], offered: list[int]) -> None:
        """Each live row appends its accepted drafts and one more token, clipped at EOS and at
        its budget; a row verify flagged (n_acc < 0: NaN/inf logits) appends nothing."""
        new_tokens = []
        for b, (row, n, m) in enumerate(zip(out, n_acc, offered)):
            if self.finished[b]:
                continue
            new = row[:n + 1][:self.budgets[b]] if n >= 0 else []
            for i, tok in enumerate(new):
                if tok in self.eos:
                    new = new[:i + 1]
                    self.finished[b] = True
                    break
            new_tokens += [(b, self.lengths[b] + i, tok) for i, tok in enumerate(new)]
            self.rows[b] += new
            self.lengths[b] += len(new)
            self.budgets[b] -= len(new)
            self.finished[b] = self.finished[b] or self.budgets[b] <= 0
            self.bad[b] = self.bad[b] or n < 0
            hits = min(max(n, 0), m)
            self.count["steps"][b] += 1
            self.count["proposed"][b] += m
            self.count["accepted"][b] += hits
            self.count["full"][b] += int(hits == m > 0)
            self.hist[b][min(max(n, 0), self.gamma_max)] += 1
        if new_tokens:   # one host-to-device copy for every row's new tokens
            rows, cols, toks = torch.tensor(new_tokens).to(self.buffer.device).unbind(1)
            self.buffer[rows, cols] = toks

    # ------------------------------------------------------------------ reads
    def mark(self) -> float:
        return time.perf_counter()

    def snapshot(self, tag: object, n_steps: int, start: float) -> Snapshot:
        c = self.count
        host = torch.tensor([c["steps"], c["proposed"], c["accepted"], c["full"], self.lengths,
                             self.budgets, self.finished, self.bad], dtype=torch.long)
        return Snapshot(host, tag, n_steps, start, self.mark())

    def tokens(self) -> list[list[int]]:
        return [list(r) for r in self.rows]

    def histogram(self) -> list[list[int]]:
        return [list(h) for h in self.hist]


def steps_left(counters: dict[str, list[int]]) -> int:
    """A guess of the steps the batch still needs: the largest live budget over the tokens per
    step seen so far (rows may end sooner, at EOS)."""
    live = [b for b, f in zip(counters["budgets"], counters["finished"]) if not f]
    if not live:
        return 0
    steps = sum(counters["steps"])
    per_step = (sum(counters["accepted"]) + steps) / steps if steps else 1.0
    return int(-(-max(live) // max(per_step, 1.0)))


def run_chunks(loop: Stepper, choose: Callable[[], tuple[Arm, object]],
               observe: Callable[[Snapshot, dict[str, list[int]]], None], max_steps: int,
               chunk: int, overlap: bool) -> None:
    """Launch chunks of up to ``chunk`` steps until every row finished (or ``max_steps`` ran).

    ``choose()`` gives (the arm of the next chunk, a tag kept in its snapshot);
    ``observe(snapshot, counters)`` hears each chunk's counters. With ``overlap`` (a captured
    loop: the device runs ahead of the host) the host waits on a chunk only once the device has
    work queued behind it: the first drafting of the next chunk where its arm drafts (a row's
    end then costs only that drafting past it), else the whole next chunk; once it has read a
    chunk it sends the rest of the next one before its own bookkeeping and choice. Decisions
    then take effect a chunk late and the device does not wait on the policy. Without it (an
    eager loop) each chunk is read before the next is chosen. Near the end chunks shrink to the
    steps the budgets still need, and when the steps in flight should suffice the host queues
    nothing until it has read them: work past the last row's end commits nothing but costs its
    time, a short wait for the host costs less.
    """
    pending: deque[Snapshot] = deque()
    launched, known = 0, None      # known: the counters of the last chunk the host has read
    read_at = 0                    # steps launched when that chunk was
    arm, tag = choose()

    def room() -> int:
        """Steps the next chunk may take: a chunk, cut to what the budgets read so far leave."""
        n = min(chunk, max_steps - launched)
        return n if known is None else min(n, steps_left(known) - (launched - read_at))

    while launched < max_steps or pending:
        ahead = None               # (arm, tag, start) of the next chunk, its drafting queued
        if launched < max_steps and not pending:
            launched += _launch(loop, pending, arm, tag, max(room(), 1), loop.mark(), launched)
            if overlap:
                continue          # queue the work that goes behind it, then wait
        elif launched < max_steps and overlap and len(pending) < 2 and room() > 0:
            if arm.drafts:
                ahead = (arm, tag, loop.mark())
                loop.draft_ahead(arm)
            else:
                launched += _launch(loop, pending, arm, tag, room(), loop.mark(), launched)
        snap = pending.popleft()
        known, read_at = snap.wait(), snap.launched
        if ahead is not None and not all(known["finished"]):
            # The chunk whose drafting is queued goes to the device before the host reads this
            # one: observe() and choose() then run while it verifies, instead of the device
            # idling on them once the drafting is done (what the step counts are is unchanged).
            run, run_tag, start = ahead
            launched += _launch(loop, pending, run, run_tag, max(room(), 1), start, launched)
        observe(snap, known)
        if all(known["finished"]):
            break
        arm, tag = choose()
    while pending:
        snap = pending.popleft()
        observe(snap, snap.wait())


def _launch(loop: Stepper, pending: deque[Snapshot], arm: Arm, tag: object, n: int,
            start, launched: int) -> int:
    """Launch a chunk of ``n`` steps and queue its snapshot; the steps launched."""
    loop.launch(arm, n)
    pending.append(loop.snapshot(tag, n, start))
    pending[-1].launched = launched + n
    return n
