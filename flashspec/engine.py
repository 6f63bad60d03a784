"""The decode loop: exact speculative decoding for a batch of prompts with ragged acceptance.

Each step: the policy picks an arm (:class:`flashspec.core.Arm`: a drafter's name and γ or a
draft tree) from past steps only; the drafter proposes;
the target scores [last committed token, drafts] in one forward; ``flashspec.verify`` accepts
a prefix and emits one more token per row. Rows advance by their own n_accepted + 1, stop at
their own EOS or length limit, and the KV caches roll back by position bookkeeping only. The
step reads one small tensor to the host (emitted tokens and counts). γ = 0 is target-only
autoregressive decoding through the very same path.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from flashspec.bandits.base import Policy, StepOutcome
from flashspec.bandits.index import FixedArm
from flashspec.bandits.rewards import reward
from flashspec.core import Arm, SamplingParams
from flashspec.drafters.base import DecodeState, Drafter
from flashspec.errors import FlashSpecError
from flashspec.graphs import GraphedStep, Prefill
from flashspec.inputs import check_generate_inputs
from flashspec.metrics import alpha, tau
from flashspec.models.llama import LlamaLM
from flashspec.planner import WidthPlanner
from flashspec.resident import COUNTERS, ResidentLoop, Snapshot, run_chunks
from flashspec.tree import compact_path, tree_attention
from flashspec.verify import Backend, get_backend
from flashspec.verify.rng import call_seed


@dataclass
class RowResult:
    """What one prompt got: its new tokens and the step statistics of its generate call."""

    tokens: list[int]
    n_prompt_tokens: int
    steps: int = 0
    n_proposed: int = 0
    n_accepted: int = 0
    accept_hist: list[int] = field(default_factory=list)
    arms: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)

    @property
    def alpha(self) -> float | None:
        return alpha(self.n_accepted, self.n_proposed)

    @property
    def tau(self) -> float | None:
        return tau(self.n_accepted, self.steps)


@dataclass
class BatchResult:
    rows: list[RowResult]
    wall_s: float
    decode_s: float
    step_s: list[float]
    capture_s: float = 0.0      # CUDA-graph capture time spent inside this call (cold start)


class SpecEngine:
    """Speculative decoding of ``target`` with a set of arms chosen by ``policy``.

    ``arms`` name their drafters (:class:`flashspec.core.Arm`); ``drafters`` are the drafter
    objects, found by their ``name`` (every drafter an arm names must be given).

    ``graphs=True`` runs the target's verify step through :class:`flashspec.graphs.GraphedStep`
    (static buffers, attention over the whole static cache; CUDA graphs on a GPU, with the fused
    verify inside where the backend allows it: ``Backend.fuses_in_graph``); ``compile=True``
    also runs that step through ``torch.compile`` before capture (fewer, fused kernels).
    ``planner`` (:class:`flashspec.planner.WidthPlanner`) verifies only as many of the arm's γ
    drafts per step as pay for their cost (0: a plain target step).

    ``resident=True`` runs the steps through :mod:`flashspec.resident`: state on the device,
    each arm's draft → verify → commit step one CUDA graph (with ``graphs`` on a GPU), replayed
    in chunks of ``chunk`` steps; the policy and the planner decide per chunk, a chunk late.
    Every drafter must support it (``Drafter.resident``) and the policy may condition on the
    step and domain only.
    """

    def __init__(self, target: LlamaLM, arms: Sequence[Arm], policy: Policy | None = None,
                 params: SamplingParams = SamplingParams(), backend: str | Backend = "torch",
                 seed: int = 0, eos_ids: Sequence[int] = (), graphs: bool = False,
                 drafters: Sequence[Drafter] = (),
                 compile: bool = False, planner: WidthPlanner | None = None,
                 resident: bool = False, chunk: int = 1) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be flashspec.verify.SamplingParams, got "
                            f"{type(params).__name__}; build one, e.g. "
                            f"SamplingParams(temperature=0.7) (from a dict: SamplingParams(**d))")
        if not arms:
            raise FlashSpecError("need at least one arm (drafter, gamma)")
        self.backend_impl = get_backend(backend)   # a name is built with default KernelOptions
        self.drafter_of: dict[str, Drafter] = {}   # by name: what an arm's drafter names
        for d in drafters:
            if self.drafter_of.setdefault(d.name, d) is not d:
                raise FlashSpecError(f"two drafters are named {d.name!r}; arms name drafters")
        for arm in arms:
            if not isinstance(arm, Arm):
                raise TypeError(f"arms are flashspec.core.Arm values, got {type(arm).__name__} "
                                "(e.g. Arm('ngram', 4), Arm.parse('eagle@dyn15'))")
            if arm.drafter is not None and arm.drafter not in self.drafter_of:
                raise FlashSpecError(f"arm {arm}: no drafter named {arm.drafter!r} among "
                                     f"drafters={sorted(self.drafter_of)}")
            if arm.tree is not None:
                if not self.drafter_of[arm.drafter].tree:
                    raise FlashSpecError(f"arm {arm}: drafter cannot draft trees")
                self.drafter_of[arm.drafter].check_tree(arm.tree)
                if self.backend_impl.verify_tree is None:
                    raise FlashSpecError(f"arm {arm}: verify backend "
                                         f"{self.backend_impl.name!r} cannot verify trees")
        self.target, self.arms, self.params = target, list(arms), params
        self.drafters = [self.drafter_of[n]
                         for n in dict.fromkeys(a.drafter for a in self.arms if a.drafts)]
        self.policy = policy if policy is not None else FixedArm(len(self.arms))
        if self.policy.n_arms != len(self.arms):
            raise FlashSpecError(f"the policy was built for {self.policy.n_arms} arms; the engine "
                                 f"has {len(self.arms)}")
        self.policy.bind_arms(self.arms)
        self.planner = planner
        self.reward_kind = self.policy.reward_kind
        adaptive = len(self.arms) > 1 and self.policy.learns
        if adaptive and self.reward_kind != "tps" and any(a.drafter is None for a in self.arms):
            raise FlashSpecError("an 'ar' arm (no speculation) proposes nothing, so only a policy "
                                 "rewarded by tokens per second (reward: tps) can score it")
        self.verify = self.backend_impl.verify
        self.seed, self.calls = seed, 0
        self.eos_ids = set(eos_ids)
        self.generator = torch.Generator(device=target.device)
        self.generator.manual_seed(seed)
        self.cache = None
        self.graphs, self.backend, self.compile = graphs, backend, compile
        self.min_capacity = 2048
        self.step_runner: GraphedStep | None = None
        self.resident, self.chunk = resident, int(chunk)
        self.resident_loop: ResidentLoop | None = None
        self.prefill: Prefill | None = None     # graphed prompt prefill of the static cache
        if resident:
            cannot = [d.name for d in self.drafters if not d.resident]
            if cannot:
                raise FlashSpecError(f"drafters {cannot} cannot draft in the resident loop; use "
                                     "runtime.resident_loop=false")
            extra = set(self.policy.context_keys) - {"step", "domain"}
            if extra:
                raise FlashSpecError(f"the resident loop gives policies the step and domain only; "
                                     f"{self.policy.label} reads {sorted(extra)}")
            if self.policy.outcome_keys:   # its chunks report sums, not each step's accepted n
                raise FlashSpecError(f"the resident loop reports chunk totals, not each step's "
                                     f"accepted drafts; {self.policy.label} reads "
                                     f"{list(self.policy.outcome_keys)}: use "
                                     "runtime.resident_loop=false")
            if self.chunk < 1:
                raise FlashSpecError(f"resident chunk must be >= 1, got {chunk}")
        self._retired_capture_s = 0.0   # capture time of step runners replaced with their cache

    # ----------------------------------------------------------------- setup
    def _start(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> DecodeState:
        reach = max(a.reach for a in self.arms)
        capacity = max(len(p) for p in prompts) + max_new_tokens + reach + 2
        limit = self.target.shape.max_positions
        if self.graphs or self.resident:  # one cache (and its graphs) for every prompt
            step = min(1024, self.min_capacity)   # a lower min_capacity (CPU tests) rounds finer
            capacity = min(max(-(-capacity // step) * step, self.min_capacity), max(limit, capacity))
        if capacity > limit:
            raise FlashSpecError(f"prompt of {max(len(p) for p in prompts)} tokens + "
                                 f"{max_new_tokens} new exceeds the context window ({limit}); "
                                 "shorten the prompt or lower max_new_tokens")
        batch = len(prompts)
        tokens = torch.zeros(batch, capacity, dtype=torch.long)
        for b, p in enumerate(prompts):
            tokens[b, :len(p)] = torch.tensor(list(p))
        state = DecodeState(tokens=tokens.to(self.target.device), lengths=[len(p) for p in prompts],
                            host_tokens=[list(p) for p in prompts], finished=[False] * batch)
        if self.cache is None or self.cache.k.shape[1] != batch or self.cache.capacity < capacity:
            self.cache = self.target.new_cache(batch, capacity)
            self._retired_capture_s = self.capture_s
            self.step_runner = self.resident_loop = self.prefill = None
        if (self.graphs or self.resident) and self.prefill is None:
            self.prefill = Prefill(self.target, self.cache, self.graphs)
        if self.graphs and not self.resident and self.step_runner is None:
            self.step_runner = GraphedStep(self.target, self.cache, self.backend_impl, self.params,
                                           compile=self.compile)
            self.step_runner.prepare(batch, self._step_widths())
        for drafter in self.drafters:
            drafter.reset(batch, capacity)
        if self.resident:
            self._prepare_resident(batch)
        elif self.graphs:
            self._graph_drafters(batch)
        width = max(state.lengths) - 1
        if width > 0:  # prefill everything but the last prompt token
            toks, pos = state.window([0] * batch, width)
            hidden = (self.prefill(toks, pos) if self.prefill is not None else
                      self.target.forward_hidden(toks, pos, self.cache, span=width))
            state.set_hidden(hidden, [0] * batch, [n - 1 for n in state.lengths])
        return state

    def _graph_drafters(self, batch: int) -> None:
        """Model drafters draft chains through CUDA graphs too (static buffers on a CPU),
        captured for every γ' up to their chain arms' largest γ (the planner may verify fewer
        drafts, and draft a chain of a tree arm's drafter); the tree step itself runs eagerly."""
        capture = self.target.device.type == "cuda"
        for drafter in self.drafters:
            gammas = [a.gamma for a in self._chain_arms() if a.drafter == drafter.name]
            if gammas:
                drafter.prepare_graphs(batch, max(gammas), self.params, self.target.device, capture)

    def _chain_arms(self) -> list[Arm]:
        """The arms that may draft a chain: chain arms, and tree arms under the planner (a
        chain of the tree's drafter, up to its depth)."""
        return [a for a in self.arms if a.tree is None or self.planner is not None]

    def _resident_arms(self) -> list[Arm]:
        """Every step the resident loop may launch: chains of γ' (the planner: any γ' <= γ, for
        a tree arm any γ' <= its depth), the tree arms, the plain arm."""
        arms: dict[Arm, None] = {}
        chains = self._chain_arms()
        for arm in self.arms:
            if not arm.drafts or self.planner is not None:
                arms[Arm()] = None
            if arm.tree is not None:
                arms[arm] = None
            if arm.drafts and arm in chains:
                for g in (range(1, arm.gamma + 1) if self.planner is not None else [arm.gamma]):
                    arms[Arm(arm.drafter, g)] = None
        return list(arms)

    def _prepare_resident(self, batch: int) -> None:
        """The resident loop of this cache, its steps captured before the prefill."""
        if self.resident_loop is None:
            self.resident_loop = ResidentLoop(self.target, self.cache, self.backend_impl,
                                              self.params, sorted(self.eos_ids), batch,
                                              max(a.gamma for a in self.arms), self.graphs,
                                              self.drafters)
        self.resident_loop.prepare(self._resident_arms())

    @property
    def capture_s(self) -> float:
        """CUDA-graph capture time spent by this engine so far (step runners and drafters)."""
        runner = self.step_runner.capture_s if self.step_runner is not None else 0.0
        runner += self.resident_loop.capture_s if self.resident_loop is not None else 0.0
        runner += self.prefill.capture_s if self.prefill is not None else 0.0
        drafters = sum(d.capture_s for d in self.drafters)
        return self._retired_capture_s + runner + drafters

    def _step_widths(self) -> dict[int, bool]:
        """Verify widths the chain arms can produce -> whether a full-q (draft logits) step
        occurs (a tree step does not run through the step runner)."""
        widths: dict[int, bool] = {1: False}
        for arm in self._chain_arms():
            one_hot = not arm.drafts or self.drafter_of[arm.drafter].one_hot
            for w in range(2, arm.gamma + 2):
                widths[w] = widths.get(w, False) or not one_hot
        return widths

    # ----------------------------------------------------------------- one step
    def _plan(self, state: DecodeState, arm: Arm, budgets: list[int]) -> tuple[Arm, list[int]]:
        """The arm with the planner's γ for this step, and the real drafts per row at that γ."""
        if self.planner is None or not arm.drafts:
            return arm, [0] * state.batch
        live = [0 if done else g for done, g in zip(state.finished, budgets)]

        def avail() -> list[int]:   # asked only when drafting might pay (n-gram: one lookup, kept)
            return self.drafter_of[arm.drafter].available(state, arm.gamma)
        if arm.tree is not None:   # the whole tree, or a chain of its drafter (0: plain)
            k = self.planner.plan_tree(arm, live)
            if k is None:
                return arm, [0] * state.batch
        else:
            k = self.planner.plan(arm.gamma, avail, live)
        if k == 0:
            return Arm(), [0] * state.batch
        return Arm(arm.drafter, k), [min(k, a) for a in avail()]

    def _propose(self, state: DecodeState, arm: Arm) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not arm.drafts:
            return torch.zeros(state.batch, 0, dtype=torch.long, device=state.device), None
        return self.drafter_of[arm.drafter].propose(state, arm.gamma, self.params, self.generator)

    def _verify(self, state: DecodeState, drafts: torch.Tensor, draft_logits: torch.Tensor | None
                ) -> tuple[list[list[int]], list[int]]:
        last = torch.tensor([t[-1] for t in state.host_tokens], device=state.device)[:, None]
        feed = torch.cat([last, drafts], dim=1)
        pos = torch.tensor(state.lengths, device=state.device)[:, None] - 1 + torch.arange(
            feed.shape[1], device=state.device)
        seed = call_seed(self.seed, self.calls)
        self.calls += 1
        if self.step_runner is not None:
            hidden, out, n_acc = self.step_runner(feed, pos, drafts, draft_logits, seed)
        else:
            hidden = self.target.forward_hidden(feed, pos, self.cache,
                                                span=max(state.lengths) + drafts.shape[1])
            out, n_acc = self.verify(self.target.logits(hidden), drafts, draft_logits, self.params, seed)
        state.set_hidden(hidden, [n - 1 for n in state.lengths], None)
        host = torch.cat([out, n_acc[:, None].to(out.dtype)], dim=1).tolist()  # the one host read
        counts = [int(row[-1]) for row in host]
        if min(counts) < 0:  # the GPU kernel flags NaN/inf logits or bad drafts without a sync
            raise FloatingPointError("verify rejected a row: NaN/inf logits or an out-of-range "
                                     "draft token; refusing to emit tokens")
        return [row[:-1] for row in host], counts

    def _tree_step(self, state: DecodeState, arm: Arm, t0: float
                   ) -> tuple[list[list[int]], list[int], float]:
        """Draft a tree, score all its nodes in one target forward (tree mask, own slots),
        verify (the backend's ``verify_tree``) and move the accepted path's K/V into
        place. Returns (out rows, n_accepted, drafting seconds)."""
        tree = self.drafter_of[arm.drafter].propose_tree(state, arm.tree, self.params,
                                                          self.generator)
        t_draft = time.perf_counter() - t0
        lengths = torch.tensor(state.lengths, device=state.device)
        span = max(state.lengths) + tree.size
        positions, attention = tree_attention(tree, lengths, span)
        hidden = self.target.forward_hidden(tree.tokens, positions, self.cache, span=span,
                                            tree=attention)
        seed = call_seed(self.seed, self.calls)
        self.calls += 1
        out, n_acc, path = self.backend_impl.verify_tree(self.target.logits(hidden), tree,
                                                         self.params, seed,
                                                         depth=arm.tree.max_depth)
        state.set_hidden(compact_path(self.cache, hidden, path, lengths),
                         [n - 1 for n in state.lengths], None)
        host = torch.cat([out, n_acc[:, None]], dim=1).tolist()         # the one host read
        counts = [int(row[-1]) for row in host]
        if min(counts) < 0:
            raise FloatingPointError("tree verify rejected a row: NaN/inf logits or an "
                                     "out-of-range draft token; refusing to emit tokens")
        return [row[:-1] for row in host], counts, t_draft

    def _commit(self, state: DecodeState, out: list[list[int]], n_acc: list[int],
                budgets: list[int]) -> list[int]:
        """Append accepted tokens (clipped at EOS and the budget); returns tokens added per row."""
        added, where = [], []
        for b, (row, n) in enumerate(zip(out, n_acc)):
            if state.finished[b]:
                added.append(0)
                continue
            new = row[:n + 1][:budgets[b]]
            for i, tok in enumerate(new):
                if tok in self.eos_ids:
                    new = new[:i + 1]
                    state.finished[b] = True
                    break
            L = state.lengths[b]
            where += [(b, L + i, tok) for i, tok in enumerate(new)]
            state.host_tokens[b].extend(new)
            state.lengths[b] = L + len(new)
            budgets[b] -= len(new)
            state.finished[b] = state.finished[b] or budgets[b] <= 0
            added.append(len(new))
        if where:  # one host-to-device copy for every row's new tokens
            rows, cols, toks = torch.tensor(where, dtype=torch.long).to(state.device).unbind(1)
            state.tokens[rows, cols] = toks
        state.hidden_valid = [min(n + 1, a) if a else 0 for n, a in zip(n_acc, added)]
        return added

    # ----------------------------------------------------------------- the loop
    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 domain: str | None = None, seed: int | None = None) -> BatchResult:
        """Decode every prompt to EOS or ``max_new_tokens``; exact for any arm sequence.

        ``seed`` restarts the random streams (drafter sampling and verify) for this call, so
        its tokens do not depend on what the engine decoded before (a resumed run equals an
        uninterrupted one); None continues the engine's streams."""
        check_generate_inputs(prompts, max_new_tokens, self.target.shape.vocab_size)
        if seed is not None:
            self.seed, self.calls = int(seed), 0
            self.generator.manual_seed(int(seed))
        t0, capture0 = time.perf_counter(), self.capture_s
        if self.resident:
            return self._generate_resident(prompts, max_new_tokens, domain, t0, capture0)
        state = self._start(prompts, max_new_tokens)
        state.domain = domain
        for drafter in self.drafters:
            drafter.start(state)
        rows = [RowResult(tokens=[], n_prompt_tokens=len(p)) for p in prompts]
        budgets = [max_new_tokens] * len(prompts)
        t_decode = time.perf_counter()
        step_s: list[float] = []
        if self.planner is not None:
            self.planner.reset(len(prompts))
        while not all(state.finished):
            ts = time.perf_counter()
            context = self._context(state, len(step_s), domain)
            arm_id = self.policy.select(context)
            arm, real = self._plan(state, self.arms[arm_id], budgets)
            active = [not f for f in state.finished]
            if arm.tree is not None:
                out, n_acc, t_draft = self._tree_step(state, arm, ts)
                verified = [arm.gamma] * state.batch
            else:
                drafts, draft_logits = self._propose(state, arm)
                t_draft = time.perf_counter() - ts
                out, n_acc = self._verify(state, drafts, draft_logits)
                # the planner's real drafts per row, else the width verified (an n-gram
                # drafter's may fall short of γ)
                verified = real if self.planner is not None else [drafts.shape[1]] * state.batch
            self._commit(state, out, n_acc, budgets)
            for drafter in self.drafters:
                drafter.observe(state, n_acc)
            step_s.append(time.perf_counter() - ts)
            if self.planner is not None and arm.tree is not None:
                self.planner.observe_tree(arm, step_s[-1], n_acc, active)
            elif self.planner is not None:   # a drafter's catch-up step says nothing of k's cost
                typical = not arm.drafts or not self.drafter_of[arm.drafter].catching_up
                self.planner.observe(arm.gamma, step_s[-1] if typical else None, real,
                                     n_acc, active)
            proposed, accepted = self._record(rows, active, arm_id, arm.gamma, n_acc)
            r = self._reward(arm.drafts, proposed, accepted, step_s[-1], t_draft,
                             sum(active))
            if r is not None:
                for row, live in zip(rows, active):
                    if live:
                        row.rewards.append(r)
                self.policy.update(arm_id, r, step_s[-1], self._outcome(context, arm_id, arm,
                                                                        verified, n_acc, active))
        for b, row in enumerate(rows):
            row.tokens = state.host_tokens[b][row.n_prompt_tokens:]
        t1 = time.perf_counter()
        return BatchResult(rows=rows, wall_s=t1 - t0, decode_s=t1 - t_decode, step_s=step_s,
                           capture_s=self.capture_s - capture0)

    def _generate_resident(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                           domain: str | None, t0: float, capture0: float) -> BatchResult:
        """:meth:`generate` through the resident loop (see :mod:`flashspec.resident`)."""
        state = self._start(prompts, max_new_tokens)
        loop = self.resident_loop
        for drafter in self.drafters:
            drafter.resident_start(state, loop.capture)
        loop.load(state, max_new_tokens, self.seed, self.calls)
        batch = len(prompts)
        rows = [RowResult(tokens=[], n_prompt_tokens=len(p)) for p in prompts]
        if self.planner is not None:
            self.planner.reset(batch)
        step_s: list[float] = []
        widest = [-1] * batch            # the largest γ' each row was live in (its histogram's)
        last = {k: [0] * batch for k in COUNTERS}
        last["budgets"] = [max_new_tokens] * batch
        t_decode = time.perf_counter()

        def choose() -> tuple[Arm, tuple[int, int, dict]]:
            context = {"step": len(step_s), "domain": domain}
            arm_id = self.policy.select(context)
            arm = self.arms[arm_id]
            k = arm.gamma
            tree = arm.tree is not None
            if self.planner is not None and k:
                live = [0 if f else b for f, b in zip(last["finished"], last["budgets"])]
                if tree:     # the tree, or a chain of its drafter, as in the reference loop
                    chain = self.planner.plan_tree(arm, live)
                    tree, k = chain is None, arm.gamma if chain is None else chain
                else:
                    k = self.planner.plan(arm.gamma, [arm.gamma if n else 0 for n in live], live)
            if tree:
                return arm, (arm_id, k, context, True)
            return (Arm(arm.drafter, k) if k else Arm()), (arm_id, k, context, False)

        def observe(snap: Snapshot, now: dict[str, list[int]]) -> None:
            delta = {k: [a - b for a, b in zip(now[k], last[k])] for k in COUNTERS[:4]}
            last.update(now)
            n_live = max(delta["steps"])
            if n_live == 0:
                return
            arm_id, k, context, played_tree = snap.tag
            seconds = snap.seconds()
            step_s.extend([seconds / snap.n_steps] * n_live)
            if self.planner is not None and played_tree:
                self.planner.observe_tree_counts(self.arms[arm_id], seconds / snap.n_steps,
                                                 sum(delta["accepted"]), sum(delta["steps"]))
            elif self.planner is not None and self.arms[arm_id].drafts:
                tries = [a + s - f for a, s, f in zip(delta["accepted"], delta["steps"], delta["full"])]
                self.planner.observe_counts(k, seconds / snap.n_steps,
                                            delta["accepted"] if k else [0] * batch,
                                            tries if k else [0] * batch)
            proposed, accepted = sum(delta["proposed"]), sum(delta["accepted"])
            r = self._reward(k > 0, proposed, accepted, seconds, seconds, sum(delta["steps"]))
            if r is not None:
                self.policy.update(arm_id, r, seconds / snap.n_steps, context)
            for b, (row, n) in enumerate(zip(rows, delta["steps"])):
                widest[b] = max(widest[b], k) if n else widest[b]
                row.arms.extend([arm_id] * n)
                if r is not None:
                    row.rewards.extend([r] * n)

        run_chunks(loop, choose, observe, max_new_tokens, self.chunk, overlap=loop.capture)
        if any(last["bad"]):
            raise FloatingPointError("verify rejected a row: NaN/inf logits or an out-of-range "
                                     "draft token; refusing to emit tokens")
        tokens, hist = loop.tokens(), loop.histogram()
        self.calls = int(loop.state.calls)
        for b, row in enumerate(rows):
            row.tokens = tokens[b][row.n_prompt_tokens:]
            row.steps, row.n_proposed = last["steps"][b], last["proposed"][b]
            row.n_accepted = last["accepted"][b]
            row.accept_hist = hist[b][:widest[b] + 1]
        t1 = time.perf_counter()
        return BatchResult(rows=rows, wall_s=t1 - t0, decode_s=t1 - t_decode, step_s=step_s,
                           capture_s=self.capture_s - capture0)

    def _reward(self, drafted: bool, proposed: int, accepted: int, wall_s: float,
                draft_s: float, n_rows: int) -> float | None:
        """The policy's reward for a step (or a resident chunk), None when it teaches nothing.

        A drafter that proposed nothing (prompt lookup without a match) earned nothing: the
        policy hears 0, or an unplayed-first index policy would pick that arm forever."""
        empty = drafted and not proposed and self.reward_kind != "tps"
        if not (proposed or empty or self.reward_kind == "tps"):
            return None
        return 0.0 if empty else reward(self.reward_kind, proposed, accepted, wall_s,
                                        max(draft_s, 1e-9), n_rows=n_rows)

    def _outcome(self, context: dict, arm_id: int, played: Arm, verified: list[int],
                 n_acc: list[int], active: list[bool]) -> dict:
        """The update context: ``context`` plus, for a policy that reads it, what the finished
        step revealed per live row (drafts verified and accepted; the played arm may be the
        planner's cut of the chosen one, a tree played as a chain of its drafter included)."""
        if "outcome" not in self.policy.outcome_keys:
            return context
        tried = [m if live and played.drafts else 0
                 for live, m in zip(active, verified)]
        accepted = [min(n, k) for n, k in zip(n_acc, tried)]
        as_chain = self.arms[arm_id].tree is not None and played.tree is None
        return {**context, "outcome": StepOutcome(np.array([tried]), np.array([accepted]),
                                                  chain=as_chain)}

    def _context(self, state: DecodeState, step: int, domain: str | None) -> dict:
        """What the policy may condition on: step, domain, and drafter features it asks for."""
        context: dict = {"step": step, "domain": domain}
        wanted = set(self.policy.context_keys) - set(context)
        for drafter in self.drafters if wanted else ():
            context.update(drafter.features(state))
        return context

    @staticmethod
    def _record(rows: list[RowResult], active: list[bool], arm_id: int, gamma: int,
                n_acc: list[int]) -> tuple[int, int]:
        """Per-row step statistics; returns (proposed, accepted) summed over the active rows."""
        proposed = accepted = 0
        for row, live, n in zip(rows, active, n_acc):
            if not live:
                continue
            row.steps += 1
            row.arms.append(arm_id)
            row.n_proposed += gamma
            row.n_accepted += n
            if len(row.accept_hist) <= gamma:
                row.accept_hist.extend([0] * (gamma + 1 - len(row.accept_hist)))
            row.accept_hist[n] += 1
            proposed, accepted = proposed + gamma, accepted + n
        return proposed, accepted
