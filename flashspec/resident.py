"""The resident decode loop: draft → verify → commit as device ops on device-resident state.

The captured stepper (:mod:`flashspec.stepper`). The reference stepper
(:class:`flashspec.stepper.ReferenceStepper`) keeps lengths, tokens and finished flags in host
lists and reads every step's result back. Here that state lives on the device (:class:`DeviceState`), and one step of an arm
(:class:`flashspec.core.Arm`: a drafter and γ) is a pure device function of it:

1. the drafter proposes γ tokens from the committed token buffer (model drafters re-read a
   fixed window of the last γ + 1 committed tokens, so the step has one shape; prompt lookup
   matches n-grams over the buffer on the device);
2. the target scores [last committed token, drafts] over its whole static cache and the
   verify backend accepts a prefix and emits one more token, with seeds derived on the device
   from the run seed and a call counter (the very seeds of the reference stepper's calls);
3. commit: accepted tokens are scattered into the buffer, clipped at EOS and at each row's
   budget; lengths, budgets, finished flags and the acceptance counters advance in place.

A draft-tree arm (a drafter and a tree shape) follows the same three steps with a tree: the drafter
grows it from the same kind of fixed window (children of sampled nodes drawn from counter-based
streams of the step's seed), the target scores every node in one pass over the whole cache
(tree attention), the backend's ``verify_tree`` walks it, and the accepted path's K/V entries
move into place before the commit.

A step is two halves: :meth:`ResidentLoop.propose` (step 1) and :meth:`ResidentLoop.settle`
(steps 2 and 3). With ``capture`` (CUDA) each half of an arm that drafts is one CUDA graph (a
plain target step is one graph), replayed back to back in chunks; after each chunk the counters
are copied asynchronously into pinned host memory with an event. The host waits on a chunk only
once the device has work queued behind it, so the GPU never idles on the host: for an arm that
drafts, the first drafting of the next chunk (:meth:`ResidentLoop.draft_ahead`), otherwise the
whole next chunk. A row that ends at EOS (no budget foretells it) thus costs one drafting past
its end where it drafts, one step where it does not. Finished rows commit nothing, so the work
launched past the end changes nothing. Policy and planner decide per chunk from the counters of
an earlier chunk: exactness never depends on them. On a CPU the same halves run eagerly (the
path the tests compare with the reference stepper).

Capture is this stepper's alone: the prompt prefill, each drafter's start on the prompts and
its catch-up windows replay from graphs it records (:class:`flashspec.graphs.GraphCache`);
drafters are plain device functions.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from flashspec.core import Arm, SamplingParams, TreeDraft, TreeShape
from flashspec.drafters.base import Drafter, does
from flashspec.errors import FlashSpecError
from flashspec.graphs import GraphCache, Prefill, bucketed, capture as capture_graph
from flashspec.models.llama import KVCache, LlamaLM
from flashspec.stepper import COUNTERS, DRAFT_STREAM, Lag, Snapshot, catch_up_widths
from flashspec.tree import compact_path, tree_attention
from flashspec.verify import rng
from flashspec.verify.api import Backend

log = logging.getLogger(__name__)


@dataclass
class DeviceState:
    """Decode state of a batch on the device; every tensor is updated in place (graph-safe)."""

    tokens: torch.Tensor     # [B, C + 1] prompt + committed tokens; column C takes masked writes
    lengths: torch.Tensor    # [B] committed length
    budgets: torch.Tensor    # [B] tokens each row may still emit
    finished: torch.Tensor   # [B] bool
    steps: torch.Tensor      # [B] steps the row was live in
    proposed: torch.Tensor   # [B] real drafts offered to the row
    accepted: torch.Tensor   # [B] drafts accepted (at most the real ones)
    full: torch.Tensor       # [B] steps where every real draft was accepted
    bad: torch.Tensor        # [B] bool: verify flagged the row (NaN/inf logits)
    hist: torch.Tensor       # [B, G + 1] accepted-count histogram
    seed: torch.Tensor       # [] run seed (low 32 bits)
    calls: torch.Tensor      # [] verify calls so far: the counter of the random streams

    @classmethod
    def allocate(cls, batch: int, capacity: int, gamma_max: int, device: torch.device
                 ) -> "DeviceState":
        z = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device=device)
        return cls(tokens=z(batch, capacity + 1), lengths=z(batch), budgets=z(batch),
                   finished=z(batch, dtype=torch.bool), steps=z(batch), proposed=z(batch),
                   accepted=z(batch), full=z(batch), bad=z(batch, dtype=torch.bool),
                   hist=z(batch, gamma_max + 1), seed=z(()), calls=z(()))

    def load(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, seed: int,
             calls: int) -> None:
        """Start a batch: the prompts, fresh counters."""
        tokens = torch.zeros(self.tokens.shape, dtype=torch.long)
        for b, p in enumerate(prompts):
            tokens[b, :len(p)] = torch.tensor(list(p))
        self.tokens.copy_(tokens)
        self.lengths.copy_(torch.tensor([len(p) for p in prompts]))
        self.budgets.fill_(max_new_tokens)
        self.finished.zero_()
        for t in (self.steps, self.proposed, self.accepted, self.full, self.bad, self.hist):
            t.zero_()
        self.seed.fill_(seed & rng.MASK32)
        self.calls.fill_(calls)

    @property
    def dump(self) -> int:
        return self.tokens.shape[1] - 1

    def counters(self) -> torch.Tensor:
        """[len(COUNTERS), B] int64 snapshot of the per-row counters (one device tensor)."""
        return torch.stack([self.steps, self.proposed, self.accepted, self.full, self.lengths,
                            self.budgets, self.finished.long(), self.bad.long()])


@dataclass
class Proposal:
    """What a step's drafting hands to its verify: the step's verify seed and its drafts (a
    chain: ``drafts`` [B, γ], their logits ``q`` and the real drafts per row ``real``; a tree;
    or nothing, for a plain target step)."""

    seed: torch.Tensor
    drafts: torch.Tensor | None = None
    q: torch.Tensor | None = None
    real: torch.Tensor | None = None
    tree: TreeDraft | None = None


@dataclass
class _Captured:
    """The CUDA graphs of one arm's step: its drafting (None for a plain target step, whose
    one graph is the whole step) and its verify + commit; ``proposal``: the drafting graph's
    output buffers, which the other graph reads; ``signature``: the drafter buffers both were
    recorded on."""

    draft: torch.cuda.CUDAGraph | None
    settle: torch.cuda.CUDAGraph
    proposal: Proposal | None
    signature: tuple


class ResidentLoop:
    """The captured stepper (:class:`flashspec.stepper.Stepper`) of a set of arms for one
    (batch, cache): ``load`` the prompts, ``launch(arm, n)`` steps of an arm, ``snapshot()``
    the counters without a stall.

    Each kind of step is an :class:`~flashspec.core.Arm` (the plain arm: a target step); its
    drafter is found by name among ``drafters``.
    """

    def __init__(self, target: LlamaLM, cache: KVCache, backend: Backend, params: SamplingParams,
                 eos_ids: Sequence[int], batch: int, gamma_max: int, capture: bool,
                 drafters: Sequence[Drafter] = ()) -> None:
        self.target, self.cache, self.params = target, cache, params
        self.drafters = list(drafters)     # every step's hidden states go to each of them
        self.drafter_of = {d.name: d for d in self.drafters}
        self.lag = Lag(self.drafters)
        self.verify, self.verify_tree = backend.verify, backend.verify_tree
        dev = target.device
        self.capture = capture and dev.type == "cuda"
        if self.capture and not backend.fuses_in_graph(params):
            log.warning("the %r verify backend cannot run inside a CUDA graph with %s: the "
                        "resident steps run uncaptured (use runtime.verify_backend=triton, "
                        "without top-k/top-p, for graphs)", backend.name, params)
            self.capture = False
        self.state = DeviceState.allocate(batch, cache.capacity, gamma_max, dev)
        self.rows = torch.arange(batch, device=dev)
        self.cols = torch.arange(gamma_max + 1, device=dev)
        self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=dev)
        self.graphs: dict[Arm, _Captured] = {}
        self._ahead: tuple[Arm, Proposal] | None = None   # a drafting queued ahead
        self.prefill = Prefill(target, cache, capture)
        # per drafter: its start on the prompts, keyed (batch, window bucket, buffers), and its
        # catch-up windows, keyed (batch, width, buffers); one memory pool each
        pool = lambda: torch.cuda.graph_pool_handle() if self.capture else None
        # (only drafters with work there: prompt lookup has no start or catch-up)
        self.starts = {d.name: GraphCache(lambda k, t, n, h, d=d: d.start(t, n, h),
                                          self.capture, pool())
                       for d in self.drafters if does(d, "start")}
        self.catch_ups = {d.name: GraphCache(lambda k, t, n, d=d: d.catch_up(t, n, k[1]),
                                             self.capture, pool())
                          for d in self.drafters if does(d, "catch_up")}
        self._steps_s = 0.0
        self._ring = [torch.zeros(len(COUNTERS), batch, dtype=torch.long,
                                  pin_memory=dev.type == "cuda") for _ in range(4)]
        self._next = 0
        self.copy_tokens = False                # set by the engine for a policy on host facts
        self._token_ring: list[torch.Tensor] = []   # the token buffer's copies, as _ring's
        self._host_rows: list[list[int]] = []   # host_tokens' rows, started by load

    @property
    def capture_s(self) -> float:
        """CUDA-graph capture time so far: steps, prefill, drafters' starts and catch-ups."""
        caches = [*self.starts.values(), *self.catch_ups.values()]
        return self._steps_s + self.prefill.capture_s + sum(c.capture_s for c in caches)

    @property
    def calls(self) -> int:
        return int(self.state.calls)

    # ------------------------------------------------------------------ graphs
    def prepare(self, arms: Sequence[Arm]) -> None:
        """Capture every arm's step (before the prefill: the warm-up steps write cache slots of
        a dummy batch, which the prompts rewrite before any query attends them)."""
        if not self.capture:
            return
        s = self.state
        for arm in arms:
            known = self.graphs.get(arm)
            if known is not None and known.signature == self._signature():
                continue
            s.lengths.fill_(arm.gamma + 2)
            s.budgets.fill_(1 << 30)
            s.finished.zero_()
            t0 = time.perf_counter()
            if arm.drafts:
                draft, proposal = capture_graph(lambda: self.propose(arm))
                draft.replay()    # the verify's warm-up runs read real drafts, not capture garbage
                settle, _ = capture_graph(lambda: self.settle(proposal, arm.tree))
            else:
                draft, proposal = None, None
                settle, _ = capture_graph(lambda: self.step(arm))
            self.graphs[arm] = _Captured(draft, settle, proposal, self._signature())
            self._steps_s += time.perf_counter() - t0
        if len(set(arms)) > 1:
            self.prepare_catch_up({arm.drafter: None for arm in arms if arm.drafts})

    def prepare_catch_up(self, drafters: Sequence[str]) -> None:
        """Record every catch-up window a drafter may need (:meth:`_catch_up`: powers of two
        from 4 to the cache) with the steps: when the loop switches between kinds of steps, a
        window captured on first use would fall inside the decode. A window recorded for this
        batch shape and these drafter buffers is not run again."""
        s, top = self.state, self.state.dump
        s.lengths.fill_(top)
        for name in (n for n in drafters if n in self.catch_ups):
            buffers = self.drafter_of[name].buffers()
            for width in catch_up_widths(top):
                self.catch_ups[name].prepare((s.tokens.shape[0], width, buffers), s.tokens,
                                             s.lengths)

    def _signature(self) -> tuple:
        """The drafter buffers the graphs were recorded on (a reallocation invalidates them):
        every step writes its hidden states to every drafter."""
        return tuple(d.buffers() for d in self.drafters)

    # ------------------------------------------------------------------ one step
    def step(self, arm: Arm) -> None:
        """One draft → verify → commit step of every row, as device ops only."""
        self.settle(self.propose(arm), arm.tree)

    def propose(self, arm: Arm) -> Proposal:
        """The drafting half of a step: γ drafts (or a tree) per row from the committed tokens,
        drawn from the step's own random stream."""
        s = self.state
        seed = rng.mix32((s.seed * rng.GOLDEN + s.calls * rng.MUL_A) & rng.MASK32)
        if not arm.drafts:
            return Proposal(seed)
        drafter = self.drafter_of[arm.drafter]
        if arm.tree is not None:
            return Proposal(seed, tree=drafter.draft_tree(s.tokens, s.lengths, arm.tree,
                                                          self.params, seed ^ DRAFT_STREAM))
        drafts, q, real = drafter.draft(s.tokens, s.lengths, arm.gamma, self.params,
                                        seed ^ DRAFT_STREAM)
        return Proposal(seed, drafts, q, real)

    def settle(self, p: Proposal, tree: TreeShape | None = None) -> None:
        """The verify + commit half of a step (``tree``: the shape of a proposed tree): the
        target scores the proposal in one pass over its whole cache, the backend accepts, the
        accepted tokens are committed."""
        if p.tree is not None:
            self._settle_tree(tree, p)
            return
        s, target = self.state, self.target
        lengths = s.lengths
        drafts = p.drafts if p.drafts is not None else lengths.new_zeros(lengths.shape[0], 0)
        gamma = drafts.shape[1]
        last = s.tokens.gather(1, (lengths - 1)[:, None])
        feed = torch.cat([last, drafts], dim=1)
        positions = (lengths - 1)[:, None] + self.cols[:gamma + 1]
        hidden = target.forward_hidden(feed, positions, self.cache)
        out, n_acc = self.verify(target.logits(hidden), drafts, p.q, self.params, p.seed)
        self._absorb(hidden, lengths)
        self._commit(out, n_acc, gamma, p.real)
        s.calls.add_(1)

    def _settle_tree(self, shape: TreeShape, p: Proposal) -> None:
        """A draft tree of every row scored in one target forward over the whole cache (tree
        attention, nodes in their own slots), verified by the backend's ``verify_tree``; the
        accepted path's K/V move into place and its features go to the drafter."""
        s, lengths, depth, tree = self.state, self.state.lengths, shape.max_depth, p.tree
        positions, attention = tree_attention(tree, lengths, self.cache.capacity)
        hidden = self.target.forward_hidden(tree.tokens, positions, self.cache, tree=attention)
        out, n_acc, path = self.verify_tree(self.target.logits(hidden), tree, self.params,
                                            p.seed, depth=depth)
        self._absorb(compact_path(self.cache, hidden, path, lengths), lengths)
        self._commit(out, n_acc, depth, None)
        s.calls.add_(1)

    def _absorb(self, hidden: torch.Tensor, lengths: torch.Tensor) -> None:
        """The target's hidden states of a step (fed at lengths - 1 + j) to every drafter, also
        those that did not draft it: a later catch-up reads them."""
        for drafter in self.drafters:
            drafter.absorb(hidden, lengths)

    def _commit(self, out: torch.Tensor, n_acc: torch.Tensor, gamma: int,
                real: torch.Tensor | None) -> None:
        """Append each live row's accepted tokens + one, clipped at EOS and its budget (the
        device form of :meth:`flashspec.stepper.ReferenceStepper.commit`)."""
        s = self.state
        live = ~s.finished
        cols = self.cols[:gamma + 1]
        emit = torch.minimum((n_acc + 1).clamp(min=0), s.budgets)   # n_acc = -1: a flagged row
        is_eos = (out[..., None] == self.eos).any(-1) & (cols < emit[:, None])
        first_eos = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, emit)
        emit = torch.minimum(emit, first_eos) * live
        valid = cols < emit[:, None]
        where = torch.where(valid, s.lengths[:, None] + cols, s.dump)
        s.tokens.scatter_(1, where, out.clamp(min=0))
        ended = (is_eos & valid).any(1)
        s.lengths.add_(emit)
        s.budgets.sub_(emit)
        s.finished.logical_or_(ended | (s.budgets <= 0))
        n = n_acc.clamp(min=0)
        offered = torch.full_like(n, gamma) if real is None else real
        hits = torch.minimum(n, offered)
        on = live.long()
        s.steps.add_(on)
        s.proposed.add_(offered * on)
        s.accepted.add_(hits * on)
        s.full.add_(((hits == offered) & (offered > 0)).long() * on)
        s.hist.index_put_((self.rows, n.clamp(max=s.hist.shape[1] - 1)), on, accumulate=True)
        s.bad.logical_or_((n_acc < 0) & live)

    # ------------------------------------------------------------------ driving
    def load(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, seed: int,
             calls: int) -> None:
        """Start a batch: the prompts into the device state, their prefill (all but each row's
        last token; :class:`flashspec.graphs.Prefill`), the drafters started on them (over a
        window padded to the prefill's bucket, one graph per bucket)."""
        s = self.state
        s.load(prompts, max_new_tokens, seed, calls)
        self._host_rows = [list(p) for p in prompts]
        batch, longest = len(prompts), max(len(p) for p in prompts)
        width = bucketed(longest, s.dump)
        positions = torch.arange(width, device=s.tokens.device).expand(batch, width)
        hidden = (self.prefill(s.tokens[:, :longest - 1], positions[:, :longest - 1])
                  if longest > 1 else None)
        padded = torch.zeros(batch, width, self.target.shape.hidden_size, dtype=self.target.dtype,
                             device=s.tokens.device)
        if hidden is not None:
            padded[:, :longest - 1] = hidden
        for d in self.drafters:
            if d.name in self.starts:
                self.starts[d.name]((batch, width, d.buffers()), s.tokens[:, :width], s.lengths,
                                    padded)
        self.lag.reset()
        self._ahead = None

    def _catch_up(self, arm: Arm) -> None:
        """Before a drafter drafts: catch it up over the latest committed tokens its window
        (the last γ + 1) would miss (:class:`flashspec.stepper.Lag` keeps the count)."""
        width = self.lag.width(arm, self.state.dump)
        if width is not None and arm.drafter in self.catch_ups:
            s = self.state
            self.catch_ups[arm.drafter]((s.tokens.shape[0], width,
                                         self.drafter_of[arm.drafter].buffers()),
                                        s.tokens, s.lengths)

    def _captured(self, arm: Arm) -> _Captured | None:
        entry = self.graphs.get(arm)
        if entry is not None and entry.signature != self._signature():
            raise FlashSpecError("a drafter reallocated its buffers after its resident step was "
                                 "captured; build the engine again for the new batch shape")
        return entry

    def _propose(self, arm: Arm, entry: _Captured | None) -> Proposal:
        if entry is None:
            return self.propose(arm)
        entry.draft.replay()
        return entry.proposal

    def draft_ahead(self, arm: Arm) -> None:
        """Queue the drafting of the next step of ``arm`` (an arm that drafts), its drafter
        caught up first; the next :meth:`launch` must be of ``arm`` and starts with the verify.
        The host queues it before it waits on the chunk in flight: the device has work while
        the host reads the counters, and if that chunk ended every row only the drafting ran
        for nothing."""
        if self._ahead is not None:
            raise FlashSpecError("a drafting is already queued ahead")
        self._catch_up(arm)
        self._ahead = (arm, self._propose(arm, self._captured(arm)))

    def launch(self, arm: Arm, n_steps: int) -> None:
        """Run ``n_steps`` steps of ``arm`` (graph replays when captured), the drafter caught
        up first where it needs it; the first drafting is skipped when it was queued ahead."""
        entry, ahead, self._ahead = self._captured(arm), self._ahead, None
        if ahead is not None and ahead[0] != arm:
            raise FlashSpecError("the drafting queued ahead is of another arm than the launch")
        if ahead is None:
            self._catch_up(arm)
        self.lag.account(arm, n_steps)
        for i in range(n_steps):
            if entry is not None and entry.draft is None:
                entry.settle.replay()           # a plain target step: one graph
                continue
            p = ahead[1] if i == 0 and ahead is not None else self._propose(arm, entry)
            if entry is not None:
                entry.settle.replay()
            else:
                self.settle(p, arm.tree)

    def mark(self) -> torch.cuda.Event | float:
        """A point in time on the device's stream (the start of a chunk)."""
        if self.capture:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def snapshot(self, tag: object, n_steps: int, start: torch.cuda.Event | float) -> Snapshot:
        """Counters after the launched steps, copied without stalling the device; ``tag``
        names the decision the chunk ran under."""
        host, tokens = self._ring[self._next], None
        if self.copy_tokens:
            if not self._token_ring or self._token_ring[0].shape != self.state.tokens.shape:
                pin = self.state.tokens.device.type == "cuda"
                self._token_ring = [torch.empty(self.state.tokens.shape, dtype=torch.long,
                                                pin_memory=pin) for _ in self._ring]
            tokens = self._token_ring[self._next]
            tokens.copy_(self.state.tokens, non_blocking=self.capture)
        self._next = (self._next + 1) % len(self._ring)
        host.copy_(self.state.counters(), non_blocking=self.capture)
        return Snapshot(host, tag, n_steps, start, self.mark(), tokens=tokens)

    def tokens(self) -> list[list[int]]:
        """Every row's committed tokens (prompt included), read once at the end."""
        lengths = self.state.lengths.tolist()
        rows = self.state.tokens[:, :max(lengths)].tolist()
        return [row[:n] for row, n in zip(rows, lengths)]

    def host_tokens(self, snapshot: Snapshot | None = None) -> list[list[int]]:
        """Every row's committed tokens, for drafters' host facts (asked once a chunk, only by
        a policy that conditions on such facts): as of ``snapshot``, a chunk the host has read,
        from the copy taken with its counters (``copy_tokens``), else as they stand, a device
        read that waits for the work in flight. Reading the copy keeps the device busy while
        the host decides (a read behind the chunk in flight cost a contextual policy's steps
        over a tenth of their time on a GPU); the facts then lag one chunk, as rewards do. The
        same list per row from one call to the next, extended by what was committed since, so
        a host index over a row (the n-gram drafter's) stays incremental."""
        rows = self._host_rows
        if snapshot is not None and snapshot.tokens is not None:
            lengths = snapshot.wait()["lengths"]
            source = snapshot.tokens
        else:
            lengths, source = self.state.lengths.tolist(), self.state.tokens
        lo, hi = min((len(r) for r in rows), default=0), max(lengths, default=0)
        if hi > lo:
            new = source[:, lo:hi].tolist()
            for row, n, fresh in zip(rows, lengths, new):
                row.extend(fresh[len(row) - lo:n - lo])
        return rows

    def histogram(self) -> list[list[int]]:
        return self.state.hist.tolist()
