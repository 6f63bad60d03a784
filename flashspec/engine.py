"""The decode driver: exact speculative decoding for a batch of prompts with ragged acceptance.

Each step: the policy picks an arm (:class:`flashspec.core.Arm`: a drafter's name and γ or a
draft tree) from past steps only; the drafter proposes; the target scores [last committed
token, drafts] in one forward; ``flashspec.verify`` accepts a prefix and emits one more token
per row. Rows advance by their own n_accepted + 1, stop at their own EOS or length limit, and
the KV caches roll back by position bookkeeping only. γ = 0 is target-only autoregressive
decoding through the very same path.

The steps run in a stepper (:mod:`flashspec.stepper`): the reference one (host state, one step
a chunk) or the captured one (:class:`flashspec.resident.ResidentLoop`: device state, CUDA
graphs, chunks). :meth:`SpecEngine.generate` is the one driver of both: policy, planner,
rewards and records read the steppers' per-row counters only.
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
from flashspec.drafters.base import Drafter, HostFacts
from flashspec.errors import FlashSpecError
from flashspec.inputs import check_generate_inputs
from flashspec.metrics import alpha, tau
from flashspec.models.llama import LlamaLM
from flashspec.planner import WidthPlanner
from flashspec.resident import ResidentLoop
from flashspec.stepper import COUNTERS, ReferenceStepper, Snapshot, Stepper, run_chunks
from flashspec.verify import Backend, get_backend


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
    ``planner`` (:class:`flashspec.planner.WidthPlanner`) verifies only as many of the arm's γ
    drafts per step as pay for their cost (0: a plain target step).

    The stepper is chosen here, once: ``graphs`` or ``resident`` run the captured stepper
    (:class:`flashspec.resident.ResidentLoop`: state on the device, each arm's step one CUDA
    graph on a GPU, replayed in chunks of ``chunk`` steps with ``resident``, one step a chunk
    with ``graphs`` alone; the policy and the planner then decide a chunk late), else the
    reference stepper (:class:`flashspec.stepper.ReferenceStepper`, one step a chunk).
    A policy that reads each step's outcome (``outcome_keys``) needs chunks of one step; one
    that reads drafters' host facts (``context_keys`` beyond step and domain) gets them from the
    committed tokens under either stepper (the captured one reads its buffer once a chunk).
    """

    def __init__(self, target: LlamaLM, arms: Sequence[Arm], policy: Policy | None = None,
                 params: SamplingParams = SamplingParams(), backend: str | Backend = "torch",
                 seed: int = 0, eos_ids: Sequence[int] = (), graphs: bool = False,
                 drafters: Sequence[Drafter] = (),
                 planner: WidthPlanner | None = None,
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
        self.seed, self.calls = seed, 0
        self.eos_ids = set(eos_ids)
        self.graphs, self.backend, self.resident = graphs, backend, resident
        self.captured = bool(graphs or resident)
        self.chunk = int(chunk) if resident else 1
        if self.chunk < 1:
            raise FlashSpecError(f"resident chunk must be >= 1, got {chunk}")
        self.min_capacity = 2048
        self.cache = None
        self.stepper: Stepper | None = None        # of this cache
        if self.policy.outcome_keys and self.chunk > 1:
            raise FlashSpecError(f"chunks of {self.chunk} steps report chunk totals, not each "
                                 f"step's accepted drafts; {self.policy.label} reads "
                                 f"{list(self.policy.outcome_keys)}: use runtime.resident_chunk=1")
        self._retired_capture_s = 0.0   # capture time of steppers replaced with their cache

    # ----------------------------------------------------------------- setup
    def _start(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> Stepper:
        """The stepper of a cache that holds this batch (a new one when the batch outgrew the
        last), its steps prepared and the drafters reset."""
        reach = max(a.reach for a in self.arms)
        capacity = max(len(p) for p in prompts) + max_new_tokens + reach + 2
        limit = self.target.shape.max_positions
        if self.captured:  # one cache (and its graphs) for every prompt
            step = min(1024, self.min_capacity)   # a lower min_capacity (CPU tests) rounds finer
            capacity = min(max(-(-capacity // step) * step, self.min_capacity), max(limit, capacity))
        if capacity > limit:
            raise FlashSpecError(f"prompt of {max(len(p) for p in prompts)} tokens + "
                                 f"{max_new_tokens} new exceeds the context window ({limit}); "
                                 "shorten the prompt or lower max_new_tokens")
        batch = len(prompts)
        if self.cache is None or self.cache.k.shape[1] != batch or self.cache.capacity < capacity:
            self.cache = self.target.new_cache(batch, capacity)
            self._retired_capture_s = self.capture_s
            self.stepper = None
        for drafter in self.drafters:
            drafter.reset(batch, self.cache.capacity)
        if self.stepper is None:
            common = (self.target, self.cache, self.backend_impl, self.params,
                      sorted(self.eos_ids), batch, max(a.gamma for a in self.arms))
            self.stepper = (ResidentLoop(*common, self.graphs, self.drafters) if self.captured
                            else ReferenceStepper(*common, self.drafters))
        self.stepper.prepare(self._step_arms())
        return self.stepper

    def _step_arms(self) -> list[Arm]:
        """Every step the stepper may launch: chains of γ' (the planner: any γ' <= γ, for a
        tree arm any γ' <= its depth), the tree arms, the plain arm."""
        arms: dict[Arm, None] = {}
        for arm in self.arms:
            if not arm.drafts or self.planner is not None:
                arms[Arm()] = None
            if arm.tree is not None:
                arms[arm] = None
            if arm.drafts and (arm.tree is None or self.planner is not None):
                for g in (range(1, arm.gamma + 1) if self.planner is not None else [arm.gamma]):
                    arms[Arm(arm.drafter, g)] = None
        return list(arms)

    @property
    def capture_s(self) -> float:
        """CUDA-graph capture time spent by this engine so far."""
        return self._retired_capture_s + (self.stepper.capture_s if self.stepper else 0.0)

    # ----------------------------------------------------------------- the driver
    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 domain: str | None = None, seed: int | None = None,
                 learn: bool = True) -> BatchResult:
        """Decode every prompt to EOS or ``max_new_tokens``; exact for any arm sequence.

        ``seed`` restarts the random streams (drafter sampling and verify) for this call, so
        its tokens do not depend on what the engine decoded before (a resumed run equals an
        uninterrupted one); None continues the engine's streams. ``learn=False`` (a warm-up):
        the policy and the planner are told nothing of these steps, whose seconds are a cold
        start's (first use of each shape), not what the arm costs."""
        check_generate_inputs(prompts, max_new_tokens, self.target.shape.vocab_size)
        if seed is not None:
            self.seed, self.calls = int(seed), 0
        t0, capture0 = time.perf_counter(), self.capture_s
        stepper = self._start(prompts, max_new_tokens)
        stepper.load(prompts, max_new_tokens, self.seed, self.calls)
        batch = len(prompts)
        rows = [RowResult(tokens=[], n_prompt_tokens=len(p)) for p in prompts]
        if self.planner is not None:
            self.planner.reset(batch)
        step_s: list[float] = []
        widest = [-1] * batch            # the largest γ' each row was live in (its histogram's)
        last = {k: [0] * batch for k in COUNTERS}
        last["budgets"] = [max_new_tokens] * batch
        t_decode = time.perf_counter()

        read: list[Snapshot] = []        # the last chunk the host read (host facts are its)
        stepper.copy_tokens = self._reads_host_facts()

        def choose() -> tuple[Arm, tuple[int, Arm, dict]]:
            context = self._context(stepper, len(step_s), domain, last["finished"],
                                    read[-1] if read else None)
            arm_id = self.policy.select(context)
            played = self._plan(self.arms[arm_id], last)
            return played, (arm_id, played, context)

        def observe(snap: Snapshot, now: dict[str, list[int]]) -> None:
            delta = {k: [a - b for a, b in zip(now[k], last[k])] for k in COUNTERS[:4]}
            last.update(now)
            read[:] = [snap]
            n_live = max(delta["steps"])
            if n_live == 0:
                return
            arm_id, played, context = snap.tag
            seconds = snap.seconds()
            step_s.extend([seconds / snap.n_steps] * n_live)
            if learn:
                self._observe_planner(self.arms[arm_id], played, seconds / snap.n_steps, delta)
            r = self._reward(played.drafts, sum(delta["proposed"]), sum(delta["accepted"]),
                             seconds, sum(delta["steps"]))
            if r is not None and learn:
                self.policy.update(arm_id, r, seconds / snap.n_steps,
                                   self._outcome(context, self.arms[arm_id], played, delta))
            for b, (row, n) in enumerate(zip(rows, delta["steps"])):
                widest[b] = max(widest[b], played.gamma) if n else widest[b]
                row.arms.extend([arm_id] * n)
                if r is not None:
                    row.rewards.extend([r] * n)

        run_chunks(stepper, choose, observe, max_new_tokens, self.chunk, overlap=stepper.capture)
        if any(last["bad"]):
            raise FloatingPointError("verify rejected a row: NaN/inf logits or an out-of-range "
                                     "draft token; refusing to emit tokens")
        tokens, hist = stepper.tokens(), stepper.histogram()
        self.calls = stepper.calls
        for b, row in enumerate(rows):
            row.tokens = tokens[b][row.n_prompt_tokens:]
            row.steps, row.n_proposed = last["steps"][b], last["proposed"][b]
            row.n_accepted = last["accepted"][b]
            row.accept_hist = hist[b][:widest[b] + 1]
        t1 = time.perf_counter()
        return BatchResult(rows=rows, wall_s=t1 - t0, decode_s=t1 - t_decode, step_s=step_s,
                           capture_s=self.capture_s - capture0)

    def _reads_host_facts(self) -> bool:
        """Whether the policy conditions on more than the step and the domain (on drafters'
        host facts, read from the committed tokens)."""
        return bool(set(self.policy.context_keys) - {"step", "domain"})

    def _context(self, stepper: Stepper, step: int, domain: str | None,
                 finished: list[int], read: Snapshot | None) -> dict:
        """What the policy may condition on: step, domain, and the drafters' host facts it
        asks for (:class:`flashspec.drafters.HostFacts`, from the tokens committed up to
        ``read``, the last chunk the host read, where the stepper copied them with it)."""
        context: dict = {"step": step, "domain": domain}
        if self._reads_host_facts():
            tokens = stepper.host_tokens(read)
            for drafter in self.drafters:
                if isinstance(drafter, HostFacts):
                    context.update(drafter.features(tokens, finished))
        return context

    def _plan(self, arm: Arm, last: dict[str, list[int]]) -> Arm:
        """The arm to play: ``arm`` cut by the planner (a chain of γ' <= γ, a tree arm's tree or
        a chain of its drafter, or the plain arm), from the counters read so far."""
        if self.planner is None or not arm.drafts:
            return arm
        live = [0 if f else b for f, b in zip(last["finished"], last["budgets"])]
        if arm.tree is not None:
            k = self.planner.plan_tree(arm, live)
            if k is None:
                return arm
        else:
            k = self.planner.plan(arm.gamma, [arm.gamma if n else 0 for n in live], live)
        return Arm(arm.drafter, k) if k else Arm()

    def _observe_planner(self, chosen: Arm, played: Arm, step_s: float,
                         delta: dict[str, list[int]]) -> None:
        """A chunk's counters to the planner: the tree's gain, or per row the accepted drafts
        and acceptance trials at the played width (a plain step the planner chose is its
        width 0; a plain arm's steps are not the planner's)."""
        if self.planner is None:
            return
        if played.tree is not None:
            self.planner.observe_tree_counts(played, step_s, sum(delta["accepted"]),
                                             sum(delta["steps"]))
        elif chosen.drafts:
            k = played.gamma
            tries = [a + s - f if k else 0
                     for a, s, f in zip(delta["accepted"], delta["steps"], delta["full"])]
            hits = delta["accepted"] if k else [0] * len(tries)
            self.planner.observe_counts(k, step_s, hits, tries)

    def _reward(self, drafted: bool, proposed: int, accepted: int, wall_s: float,
                n_rows: int) -> float | None:
        """The policy's reward for a chunk of steps, None when it teaches nothing.

        A drafter that proposed nothing (prompt lookup without a match) earned nothing: the
        policy hears 0, or an unplayed-first index policy would pick that arm forever."""
        empty = drafted and not proposed and self.reward_kind != "tps"
        if not (proposed or empty or self.reward_kind == "tps"):
            return None
        return 0.0 if empty else reward(self.reward_kind, proposed, accepted, wall_s,
                                        max(wall_s, 1e-9), n_rows=n_rows)

    def _outcome(self, context: dict, chosen: Arm, played: Arm,
                 delta: dict[str, list[int]]) -> dict:
        """The update context: ``context`` plus, for a policy that reads it, what the step
        revealed per row (real drafts verified and accepted, from the counters of a one-step
        chunk; 0 for a row that was not live). The played arm may be the planner's cut of the
        chosen one, a tree played as a chain of its drafter included."""
        if "outcome" not in self.policy.outcome_keys:
            return context
        as_chain = chosen.tree is not None and played.tree is None
        return {**context, "outcome": StepOutcome(np.array([delta["proposed"]]),
                                                  np.array([delta["accepted"]]), chain=as_chain)}
