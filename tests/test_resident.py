"""The captured stepper's device-state logic (commit, EOS, budgets, ragged acceptance, seeds,
drafters' catch-up) against the reference stepper, the oracle, on SmolLM2 cut to four layers
(real weights, fp32, CPU: every step eager). Both draft through the same drafter protocol, so
their tokens, steps, counters and histograms agree exactly, greedy and sampled.

The distribution gate of the resident path is in test_exactness_engine.py (``*_resident``).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from flashspec.bandits import UCB1
from flashspec.bandits.base import Policy
from flashspec.bandits.contextual import PerDomain
from flashspec.core import Arm, SamplingParams
from flashspec.drafters import DraftContext, EagleDrafter, ModelDrafter, NgramDrafter
from flashspec.drafters.ngram import device_lookup, lookup
from flashspec.engine import SpecEngine
from flashspec.errors import FlashSpecError
from flashspec.graphs import Prefill
from flashspec.models import load_model
from flashspec.planner import WidthPlanner
from flashspec.resident import ResidentLoop
from flashspec.stepper import Snapshot, catch_up_width, catch_up_widths, run_chunks
from test_engine import load_small_model
from conftest import drive_as_on_a_gpu
from test_exactness_engine import EAGLE

TEXTS = ["def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
         "List the colours of the rainbow, then list them again in reverse order.",
         "Count from one to twenty in words, separated by commas: one, two, three,"]
NEW = 24
pytestmark = pytest.mark.slow


@st.composite
def buffers(draw):
    rows = draw(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=24), min_size=1, max_size=4))
    return rows, draw(st.integers(1, 6)), draw(st.integers(1, 4)), draw(st.integers(1, 4))


@settings(max_examples=200, deadline=None)
@given(buffers())
def test_device_lookup_equals_host_lookup(case):
    rows, gamma, a, b = case
    max_n, min_n = max(a, b), min(a, b)
    tokens = torch.zeros(len(rows), 33, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = torch.tensor(r)
    drafts, real = device_lookup(tokens, torch.tensor([len(r) for r in rows]), gamma, max_n, min_n)
    for i, r in enumerate(rows):
        want = lookup(r, gamma, max_n, min_n)
        assert real[i].item() == len(want) and drafts[i, :len(want)].tolist() == want


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    model, tok = load_small_model(tmp_path_factory, n_layers=4)
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       return_dict=True)["input_ids"] for t in TEXTS]
    return model, prompts


@pytest.fixture(scope="module")
def drafters(small):
    model, _ = small
    return {"ngram": NgramDrafter(), "skip": ModelDrafter(model, [0, 1], name="skip"),
            "eagle": EagleDrafter.build(DraftContext(model), "eagle", checkpoint=str(EAGLE))}


@pytest.fixture(scope="module")
def eos(small):
    """An end token that greedy row 0 first reaches mid-stream (at its 7th token or later), so
    EOS clipping inside an accepted run is exercised."""
    model, prompts = small
    row = SpecEngine(model, [Arm()]).generate(prompts[:1], NEW).rows[0].tokens
    return [next(t for i, t in enumerate(row) if i >= 6 and t not in row[:i])]


def run(model, prompts, arms, eos, drafters=(), **kw):
    """``arms`` of ``drafters`` (a dict of them, by name: the fixtures')."""
    drafters = list(drafters.values()) if isinstance(drafters, dict) else list(drafters)
    return SpecEngine(model, arms, eos_ids=eos, drafters=drafters, **kw).generate(
        prompts, NEW, seed=11).rows


def test_captured_stepper_skips_hooks_a_drafter_does_not_have(small, drafters, eos):
    """Prompt lookup has no start and no catch-up: the captured stepper keeps no graph cache
    for them (on a GPU a graph of nothing is an empty capture), and runs it beside drafters that
    have both, greedy output still the AR's."""
    from flashspec.drafters.base import does
    assert not does(drafters["ngram"], "start") and not does(drafters["ngram"], "catch_up")
    assert does(drafters["eagle"], "start") and does(drafters["eagle"], "catch_up")
    model, prompts = small
    arms = [Arm("ngram", 3), Arm("eagle", 3)]
    engine = SpecEngine(model, arms, eos_ids=eos, drafters=list(drafters.values()),
                        policy=Cycle(len(arms), 2), resident=True, chunk=2)
    rows = engine.generate(prompts, NEW, seed=11).rows
    assert set(engine.stepper.starts) == set(engine.stepper.catch_ups) == {"eagle"}
    ar = run(model, prompts, [Arm()], eos)
    assert [r.tokens for r in rows] == [r.tokens for r in ar]


@pytest.mark.parametrize("name,gamma", [("ngram", 4), ("skip", 3), ("eagle", 3), ("eagle", 1)])
def test_resident_equals_reference_loop(small, drafters, eos, name, gamma):
    """Same tokens (EOS inside accepted runs, ragged prompts, budget clipping), steps,
    proposed and accepted counts and acceptance histograms, at B = 1 and 3."""
    model, prompts = small
    arms = [Arm(name, gamma)]
    ref = run(model, prompts, arms, eos, drafters)
    ar = run(model, prompts, [Arm()], eos)
    assert [r.tokens for r in ref] == [r.tokens for r in ar]
    assert 7 <= len(ar[0].tokens) < NEW and ar[0].tokens[-1] == eos[0]
    for chunk in (1, 5):
        batch = run(model, prompts, arms, eos, drafters, resident=True, chunk=chunk)
        single = [run(model, [p], arms, eos, drafters, resident=True, chunk=chunk)[0]
                  for p in prompts]
        for got in (batch, single):
            assert [r.tokens for r in got] == [r.tokens for r in ref]
            assert [(r.steps, r.n_proposed, r.n_accepted, r.accept_hist) for r in got] == \
                   [(r.steps, r.n_proposed, r.n_accepted, r.accept_hist) for r in ref]
            assert [len(r.arms) for r in got] == [r.steps for r in got]


def test_bucketed_prefill_keeps_the_prompts_states(small):
    """The graph engines' prefill pads the window to a bucket: the prompt's hidden states and
    cache slots equal the eager prefill's; the padding writes only slots past the prompt."""
    model, prompts = small
    n = len(prompts[1]) - 1
    tokens, positions = torch.tensor([prompts[1][:-1]]), torch.arange(n)[None]
    eager_cache, padded_cache = model.new_cache(1, 96), model.new_cache(1, 96)
    with torch.inference_mode():
        eager = model.forward_hidden(tokens, positions, eager_cache, span=n)
        prefill = Prefill(model, padded_cache, capture=False, bucket=16)
        padded = prefill(tokens, positions)
    assert n % 16 and padded.shape == eager.shape
    assert list(prefill.graphs.slots) == [(1, -(-n // 16) * 16)]
    torch.testing.assert_close(padded, eager)
    torch.testing.assert_close(padded_cache.k[..., :n, :], eager_cache.k[..., :n, :])
    torch.testing.assert_close(padded_cache.v[..., :n, :], eager_cache.v[..., :n, :])
    assert not padded_cache.k[..., -(-n // 16) * 16:, :].any()


def test_resident_budget_and_max_new_tokens_one(small, drafters):
    model, prompts = small
    for new in (1, 2, 7):
        rows = SpecEngine(model, [Arm("ngram", 6)], resident=True,
                          drafters=[drafters["ngram"]]).generate(prompts, new).rows
        assert [len(r.tokens) for r in rows] == [new] * len(prompts)


def test_resident_sampling_uses_the_reference_seeds(small, eos):
    """At T = 1 target-only decoding draws from the same counter-based seeds in both loops,
    so the tokens agree exactly; and the chunk size never changes a sampled run."""
    model, prompts = small
    params = SamplingParams(temperature=1.0)
    ref = run(model, prompts, [Arm()], eos, params=params)
    got = run(model, prompts, [Arm()], eos, params=params, resident=True, chunk=3)
    assert [r.tokens for r in got] == [r.tokens for r in ref]


@pytest.mark.parametrize("name", ["skip", "eagle", "ngram"])
def test_resident_sampled_run_equals_reference_at_any_chunking(small, drafters, eos, name):
    """Sampled drafts and verifies draw from the same counter-based streams of the steps' seeds
    in both steppers: the same tokens and counters, whatever the chunk size."""
    model, prompts = small
    params = SamplingParams(temperature=1.0, top_k=20)
    arms = [Arm(name, 3)]
    ref = run(model, prompts, arms, eos, drafters, params=params)
    a = run(model, prompts, arms, eos, drafters, params=params, resident=True, chunk=1)
    b = run(model, prompts, arms, eos, drafters, params=params, resident=True, chunk=6)
    for got in (a, b):
        assert [(r.tokens, r.n_proposed, r.n_accepted) for r in got] == \
               [(r.tokens, r.n_proposed, r.n_accepted) for r in ref]


def test_resident_bandit_and_planner_keep_greedy_output(small, drafters, eos):
    model, prompts = small
    ar = [r.tokens for r in run(model, prompts, [Arm()], eos)]
    arms = [Arm("ngram", 4), Arm("skip", 2), Arm("eagle", 3)]
    policy = UCB1(len(arms), seed=0)
    got = run(model, prompts, arms, eos, drafters, policy=policy, resident=True, chunk=2)
    assert [r.tokens for r in got] == ar
    assert min(policy.counts) > 0, "every arm must have been tried"
    planner = WidthPlanner(explore=1)
    got = run(model, prompts, [Arm("eagle", 4)], eos, drafters, planner=planner, resident=True,
              chunk=2)
    assert [r.tokens for r in got] == ar
    assert set(planner.seen) >= {0, 2, 4}, "the planner probes widths 0, γ/2 and γ"


class Cycle(Policy):
    """Plays arm 0 for ``run`` steps (``run + lead`` the first time), then arm 1, ... (a fixed
    schedule, no learning)."""

    name = "cycle"
    learns = False

    def __init__(self, n_arms: int, run: int, lead: int = 0) -> None:
        super().__init__(n_arms)
        self.run, self.lead, self.calls = run, lead, 0

    def select_many(self, context=None) -> np.ndarray:
        arm = (max(self.calls - self.lead, 0) // self.run) % self.n_arms
        self.calls += 1
        return np.array([arm])


@pytest.fixture(scope="module")
def smol():
    """The whole SmolLM2 (fp32) with the trained EAGLE drafter and its rank-72 head, and a
    layer-skip drafter: drafters that are accepted often enough for their drafts to show."""
    from flashspec.heads import LowRankChoice
    model, tok = load_model("smollm2")
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       return_dict=True)["input_ids"] for t in TEXTS]
    eagle = EagleDrafter.build(DraftContext(model, tok), "eagle", checkpoint=str(EAGLE),
                               head=LowRankChoice(rank=72, init="trained"))
    return model, prompts, {"eagle": eagle, "skip": ModelDrafter(model, list(range(26)),
                                                                 name="skip")}


@pytest.mark.parametrize("name", ["eagle", "skip"])
def test_drafters_catch_up_after_steps_they_did_not_draft(smol, name):
    """Plain target steps, and a narrower γ after a wider one, commit tokens outside the
    drafter's fixed drafting window: both steppers catch the drafter up over them before it
    drafts again, and keep the prompt's features when the first step is not the drafter's. They
    then draft alike: same tokens, steps, accepted counts and histograms, with drafts accepted
    (this schedule never leaves a drafter behind by more than its window, so the catch-up itself
    is tested by the next test; the layer-skip drafter reads the target's own cache and cannot
    fall behind)."""
    model, prompts, drafters = smol
    drafter = drafters[name]
    arms = [Arm(), Arm(name, 4), Arm(name, 1), Arm(name, 3)]
    ref = run(model, prompts, arms, [], drafters, policy=Cycle(len(arms), 3))
    got = run(model, prompts, arms, [], drafters, policy=Cycle(len(arms), 3), resident=True,
              chunk=1)
    assert sum(r.n_accepted for r in ref) > 10
    assert [r.tokens for r in got] == [r.tokens for r in ref]
    assert [(r.steps, r.n_accepted, r.accept_hist) for r in got] == \
           [(r.steps, r.n_accepted, r.accept_hist) for r in ref]


@pytest.mark.parametrize("gammas,run_len", [((0, 1), 6), ((4, 1), 2)])
def test_eagle_catch_up_is_needed_and_done(smol, monkeypatch, gammas, run_len):
    """Schedules that leave EAGLE behind by more than its resident window (γ + 1 tokens): six
    plain steps before a γ1 step, or a γ1 step after a γ4 step that committed up to five
    tokens. With the catch-up the captured stepper drafts as the reference stepper does (same steps,
    accepted counts, histograms); with ``ResidentLoop._catch_up`` planted as a no-op it does
    not (the schedule of the test above never falls that far behind, and passes either way)."""
    model, prompts, drafters = smol
    arms = [Arm("eagle" if g else None, g) for g in gammas]
    ref = run(model, prompts, arms, [], drafters, policy=Cycle(len(arms), run_len))
    stats = lambda rows: [(r.steps, r.n_accepted, r.accept_hist) for r in rows]
    got = run(model, prompts, arms, [], drafters, policy=Cycle(len(arms), run_len), resident=True,
              chunk=1)
    assert stats(got) == stats(ref) and sum(r.n_accepted for r in ref) > 10
    monkeypatch.setattr(ResidentLoop, "_catch_up", lambda self, arm: None)
    planted = run(model, prompts, arms, [], drafters, policy=Cycle(len(arms), run_len),
                  resident=True, chunk=1)
    assert stats(planted) != stats(ref)


@pytest.mark.parametrize("name,gamma", [("eagle", 3), ("ngram", 4)])
def test_drafting_ahead_equals_reference_loop(small, drafters, eos, overlapped, name, gamma):
    """Driven as on a GPU (each chunk's first drafting queued ahead of the host's read), a
    resident run gives the reference stepper's tokens, steps, counts and histograms: the
    drafting of a step only moved before the host's wait."""
    model, prompts = small
    arms = [Arm(name, gamma)]
    ref = run(model, prompts, arms, eos, drafters)
    for chunk in (1, 3):
        got = run(model, prompts, arms, eos, drafters, resident=True, chunk=chunk)
        assert [(r.tokens, r.steps, r.n_proposed, r.n_accepted, r.accept_hist) for r in got] == \
               [(r.tokens, r.steps, r.n_proposed, r.n_accepted, r.accept_hist) for r in ref]


@pytest.mark.parametrize("name", ["eagle", "skip"])
def test_drafting_ahead_catches_drafters_up(smol, monkeypatch, name):
    """Driven as on a GPU, the policy's choices take effect a chunk late (the second chunk
    repeats the first choice), and a drafter's catch-up runs before a drafting queued ahead:
    switching between plain steps and chains of several γ gives the reference stepper's tokens,
    steps, accepted counts and histograms under the same schedule, with the catch-ups of the
    eager resident loop (over the same windows)."""
    model, prompts, drafters = smol
    drafter = drafters[name]
    arms = [Arm(), Arm(name, 4), Arm(name, 1), Arm(name, 3)]
    widths: dict[str, list[int]] = {"eager": [], "ahead": []}
    catch_up = drafter.catch_up
    ref = run(model, prompts, arms, [], drafters, policy=Cycle(len(arms), 3, lead=1))
    assert sum(r.n_accepted for r in ref) > 10
    try:
        for mode, lead in (("eager", 1), ("ahead", 0)):
            if mode == "ahead":
                drive_as_on_a_gpu(monkeypatch)
            drafter.catch_up = lambda *a, _w=widths[mode]: (_w.append(a[2]), catch_up(*a))[1]
            got = run(model, prompts, arms, [], drafters, policy=Cycle(len(arms), 3, lead=lead),
                      resident=True, chunk=1)
            assert [r.arms for r in got] == [r.arms for r in ref]
            assert [(r.tokens, r.steps, r.n_accepted, r.accept_hist) for r in got] == \
                   [(r.tokens, r.steps, r.n_accepted, r.accept_hist) for r in ref]
    finally:
        del drafter.catch_up
    assert widths["ahead"] == widths["eager"] and len(widths["eager"]) >= 2


def test_prepare_catch_up_runs_each_window_once(small, drafters):
    """Before each batch, ``ResidentLoop.prepare`` readies every catch-up window of a drafter
    (on a GPU: records its graph). A window the stepper already has for that batch shape and
    those drafter buffers runs nothing again (a later batch replays nothing inside its timing).
    Eager here: the same GraphCache slots."""
    model, prompts = small
    eagle = drafters["eagle"]
    engine = SpecEngine(model, [Arm("eagle", 3)], drafters=[eagle], resident=True)
    engine.min_capacity = 64
    engine.generate(prompts, 4)
    loop, calls = engine.stepper, []
    loop.catch_ups["eagle"].clear()
    widths = catch_up_widths(loop.state.dump)
    inner = eagle._catch_up
    eagle._catch_up = lambda t, p, span: (calls.append(t.shape), inner(t, p, span))[1]
    try:
        with torch.inference_mode():                 # as the engine runs it
            loop.prepare_catch_up(["eagle"])
            assert calls == [(len(prompts), w) for w in widths]
            loop.prepare_catch_up(["eagle"])           # nothing
            assert len(calls) == len(widths)
    finally:
        del eagle._catch_up
        loop.catch_ups["eagle"].clear()


@pytest.mark.parametrize("top", [3, 5, 64, 1024, 1030, 4096])
def test_catch_up_windows_captured_up_front_cover_every_window(top):
    """On a GPU, ``ResidentLoop.prepare`` captures the catch-up windows of ``catch_up_widths``
    before the prefill; a window outside that set would be captured inside the decode. Every
    lag a drafter can have (> γ + 1 >= 2 tokens, up to the whole buffer and past it) maps into
    the set, each window covers its lag unless the buffer is shorter, and nothing else is in it."""
    widths = catch_up_widths(top)
    got = {catch_up_width(behind, top) for behind in range(3, 2 * top + 3)}
    assert got == set(widths)
    assert all(catch_up_width(b, top) >= min(b, top) for b in range(3, 2 * top + 3))
    assert all(w == top or w & (w - 1) == 0 for w in widths)   # one graph per power of two


def test_contextual_policy_reads_host_facts_under_the_captured_stepper(small, drafters, eos,
                                                                      overlapped):
    """A policy conditioned on the n-gram drafter's host fact (does the text so far repeat?)
    runs on the captured stepper too, driven as on a GPU: the stepper reads its token buffer
    once a chunk, both values of the fact reach the policy, greedy output stays AR's."""
    model, prompts = small
    ar = [r.tokens for r in run(model, prompts, [Arm()], eos)]
    arms = [Arm("ngram", 2), Arm("skip", 2)]
    seen: list = []

    class Recording(PerDomain):
        def select(self, context=None):
            seen.append(context["ngram_hit"])
            return super().select(context)

    policy = Recording(2, seed=0, key="ngram_hit")
    got = run(model, prompts, arms, eos, drafters, policy=policy, resident=True, chunk=2)
    assert [r.tokens for r in got] == ar
    assert set(seen) == {True, False}


def test_host_facts_are_read_incrementally_and_are_exact(small, drafters, eos, overlapped,
                                                          monkeypatch):
    """The captured stepper hands host facts the same row lists from chunk to chunk, extended
    by what was committed since, so the n-gram drafter's index over a row is built once a
    batch (not over the whole history every chunk, which made a contextual policy's steps
    far longer than its arms' on a GPU). Every list it hands is the row's committed prefix and
    every fact equals one computed from scratch on it; the reference stepper does the same."""
    from flashspec.drafters import ngram

    model, prompts = small
    builds, handed = [], []
    init, features = ngram.NgramIndex.__init__, ngram.NgramDrafter.features
    monkeypatch.setattr(ngram.NgramIndex, "__init__",
                        lambda self, *a: (builds.append(1), init(self, *a))[1])

    def recorded(self, tokens, finished):
        got = features(self, tokens, finished)
        handed.append(([list(t) for t in tokens], list(finished), got))
        return got

    monkeypatch.setattr(ngram.NgramDrafter, "features", recorded)
    arms = [Arm("ngram", 2), Arm("skip", 2)]
    for resident in (False, True):
        builds.clear(), handed.clear()
        rows = run(model, prompts, arms, eos, drafters, resident=resident, chunk=2,
                   policy=PerDomain(2, seed=0, key="ngram_match"))
        assert len(builds) == len(prompts), (resident, len(builds))   # one index per row
        assert len({len(h[0][0]) for h in handed}) >= 3   # several chunks read
        final = [list(p) + r.tokens for p, r in zip(prompts, rows)]
        for lists, finished, got in handed:
            assert all(f[:len(t)] == t for f, t in zip(final, lists))
            assert got == features(ngram.NgramDrafter(), lists, finished)


def test_host_facts_come_from_the_chunk_read_not_the_buffer(small, drafters, eos, overlapped,
                                                           monkeypatch):
    """Driven as on a GPU (the next chunk in flight while the host decides), the captured
    stepper hands host facts the tokens of the chunk the host last read, from the copy taken
    with its counters: the live buffer, already ahead by the chunk in flight, is not read (a
    device read there waits for that chunk, which cost a contextual policy's steps over a tenth
    of their time on an H100). The output is still the target's greedy output."""
    handed, ahead = [], []
    host_tokens = ResidentLoop.host_tokens

    def recorded(self, snapshot=None):
        assert snapshot is None or snapshot.tokens is not None    # copy_tokens was set
        live = self.state.lengths.tolist()
        rows = host_tokens(self, snapshot)
        if snapshot is not None:
            handed.append(([len(r) for r in rows], snapshot.wait()["lengths"]))
            ahead.append(any(a > b for a, b in zip(live, handed[-1][1])))
        return rows

    monkeypatch.setattr(ResidentLoop, "host_tokens", recorded)
    model, prompts = small
    arms = [Arm("ngram", 2), Arm("skip", 2)]
    rows = run(model, prompts, arms, eos, drafters, resident=True, chunk=2,
               policy=PerDomain(2, seed=0, key="ngram_match"))
    assert handed and all(got == read for got, read in handed)
    assert any(ahead)           # the buffer was ahead of the chunk read when the host decided
    plain = run(model, prompts, [Arm("ngram", 2)], eos, drafters)
    assert [r.tokens for r in rows] == [r.tokens for r in plain]


def test_resident_refuses_what_it_cannot_run(small, drafters):
    model, _ = small
    arms = [Arm("ngram", 2), Arm("skip", 2)]
    with pytest.raises(FlashSpecError, match="chunk"):
        SpecEngine(model, arms[:1], resident=True, chunk=0, drafters=[drafters["ngram"]])


@pytest.mark.parametrize("resident", [False, True])
def test_flags_nan_logits(small, drafters, resident):
    """A NaN in the target's logits stops the run with an error instead of emitting tokens."""
    model, prompts = small
    engine = SpecEngine(model, [Arm("ngram", 2)], resident=resident, drafters=[drafters["ngram"]])
    saved = model.lm_head.weight.data[0, 0].item()
    model.lm_head.weight.data[0, 0] = float("nan")
    try:
        with pytest.raises(FloatingPointError):
            engine.generate(prompts[:1], 4)
    finally:
        model.lm_head.weight.data[0, 0] = saved


class _ScriptedLoop:
    """The driving surface of a captured ResidentLoop (one row emitting ``per_step`` tokens a
    step up to its budget), to check run_chunks' schedule without a GPU."""

    def __init__(self, budget: int, per_step: int, eos_step: int | None = None) -> None:
        self.budget, self.left, self.per_step = budget, budget, per_step
        self.eos_step = eos_step      # the row emits EOS in this step (budgets cannot tell)
        self.live_steps, self.launched, self.drafted_ahead = 0, [], 0
        self.ahead = None

    def mark(self) -> float:
        return 0.0

    def draft_ahead(self, arm) -> None:
        assert self.ahead is None
        self.ahead, self.drafted_ahead = arm, self.drafted_ahead + 1

    def launch(self, arm, n_steps: int) -> None:
        assert isinstance(n_steps, int) and n_steps >= 1
        assert self.ahead in (None, arm)
        self.ahead = None
        self.launched.append(n_steps)
        for _ in range(n_steps):
            if self.left > 0 and self.live_steps != self.eos_step:
                self.live_steps += 1
                self.left -= min(self.per_step, self.left)

    def snapshot(self, tag, n_steps: int, start: float) -> Snapshot:
        emitted = self.budget - self.left
        row = [self.live_steps, 0, emitted - self.live_steps, 0, emitted, self.left,
               int(self.left <= 0 or self.live_steps == self.eos_step), 0]
        return Snapshot(torch.tensor(row)[:, None], tag, n_steps, start, 0.0)


DRAFTING, PLAIN = Arm("drafter", 1), Arm()


@pytest.mark.parametrize("arm", [DRAFTING, PLAIN])
@pytest.mark.parametrize("per_step", [1, 3, 5])
def test_run_chunks_launches_whole_steps_and_few_past_the_end(per_step, arm):
    """Chunks are whole step counts, and with the host a chunk behind, at most one chunk of
    steps runs past the row's end."""
    loop, seen = _ScriptedLoop(128, per_step), []
    run_chunks(loop, lambda: (arm, None), lambda snap, now: seen.append(now), 128, 2,
               overlap=True)
    needed = -(-128 // per_step)
    assert loop.left == 0 and seen[-1]["finished"] == [1]
    assert needed <= sum(loop.launched) <= needed + 2


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_run_chunks_past_an_eos(chunk):
    """A row that ends at EOS (no budget foretells it) leaves the rest of its chunk to run past
    its end, and then the work queued behind it: for an arm that drafts, the first drafting of
    the next chunk (so chunks of 1, the default, waste no verify step); for a plain target
    step, the whole next chunk (between chunk and 2 chunk - 1 steps)."""
    for arm, fewest, most in ((DRAFTING, 0, chunk - 1), (PLAIN, chunk, 2 * chunk - 1)):
        waste = []
        for eos_step in range(9, 9 + chunk):
            loop, seen = _ScriptedLoop(128, 3, eos_step=eos_step), []
            run_chunks(loop, lambda: (arm, None), lambda snap, now: seen.append(now), 128,
                       chunk, overlap=True)
            assert seen[-1]["finished"] == [1] and loop.live_steps == eos_step
            waste.append(sum(loop.launched) - eos_step)
            # every chunk but the first had its drafting queued ahead, and one more ran past
            assert loop.drafted_ahead == (len(loop.launched) if arm is DRAFTING else 0)
        assert min(waste) == fewest and max(waste) == most


@pytest.mark.parametrize("chunk", [1, 2])
def test_run_chunks_sends_the_next_chunk_before_the_host_reads_one(chunk):
    """With its drafting queued ahead, the next chunk goes to the device as soon as the host
    has read a chunk: observe() and choose() run while it verifies (on a captured loop the
    device would otherwise idle on the policy). The last read, a finished row, sends nothing."""
    loop, sent = _ScriptedLoop(128, 3), []
    run_chunks(loop, lambda: (DRAFTING, None),
               lambda snap, now: sent.append(len(loop.launched)), 128, chunk, overlap=True)
    assert sent[:-1] == list(range(2, len(sent) + 1)) and sent[-1] == len(sent)
    assert sum(loop.launched) <= -(-128 // 3) + chunk
