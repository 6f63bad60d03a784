"""Goodput width planner and the incremental n-gram index (CPU, tiny random model)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashspec.core import Arm
from flashspec.drafters import NgramDrafter
from flashspec.drafters.ngram import NgramIndex, lookup
from flashspec.engine import SpecEngine
from flashspec.errors import FlashSpecError
from flashspec.models.llama import LlamaLM, LlamaShape
from flashspec.planner import WidthPlanner
from flashspec.theory import expected_tau


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60),
       sizes=st.tuples(st.integers(1, 4), st.integers(1, 4)), gamma=st.integers(1, 8),
       every=st.integers(1, 7))
def test_index_equals_scan(tokens, sizes, gamma, every):
    """Queried as the list grows (every few tokens), the index returns what the scan returns."""
    hi, lo = max(sizes), min(sizes)
    index = NgramIndex(hi, lo)
    for n in range(1, len(tokens) + 1):
        if n % every == 0 or n == len(tokens):
            assert index.query(tokens[:n], gamma) == lookup(tokens[:n], gamma, hi, lo)


def warm(planner: WidthPlanner, costs: dict[int, float], gamma: int) -> None:
    """Feed the exploration steps with the given step costs (no drafts)."""
    for _ in range(planner.explore * len(costs)):
        k = planner.plan(gamma, [gamma], [100])
        planner.observe_counts(k, costs[k], [0], [0])
    assert all(planner.seen[k] == planner.explore for k in costs)


def test_explores_probe_widths_first():
    planner = WidthPlanner(explore=2)
    planner.reset(1)
    seen = []
    for _ in range(6):
        k = planner.plan(8, [8], [100])
        seen.append(k)
        planner.observe_counts(k, 1.0, [0], [1 if k else 0])
    assert sorted(seen) == [0, 0, 4, 4, 8, 8]


def test_picks_ar_when_verify_is_expensive_and_drafts_fail():
    planner = WidthPlanner()
    planner.reset(1)
    warm(planner, {0: 1.0, 4: 2.0, 8: 3.0}, 8)
    for _ in range(5):   # drafts keep failing: acceptance estimate falls
        planner.observe_counts(8, 3.0, [0], [1])
    assert planner.plan(8, [8], [100]) == 0


def test_picks_wide_when_cheap_and_accepted():
    planner = WidthPlanner()
    planner.reset(1)
    warm(planner, {0: 1.0, 4: 1.05, 8: 1.1}, 8)
    for _ in range(10):
        planner.observe_counts(8, 1.1, [8], [8])
    assert planner.plan(8, [8], [100]) == 8
    assert planner.plan(8, [3], [100]) == 3, "no gain from verifying past the real drafts"
    assert planner.plan(8, [0], [100]) == 0, "nothing to verify"


def test_makespan_weights_only_the_rows_that_decide_the_end():
    """Row 0 (far ahead) drafts well, row 1 (the straggler) has nothing: AR for the batch."""
    planner = WidthPlanner(objective="makespan")
    planner.reset(2)
    warm(planner, {0: 1.0, 4: 1.6, 8: 2.0}, 8)
    for _ in range(10):
        planner.observe_counts(8, 2.0, [8, 0], [8, 0])
    assert planner.plan(8, [8, 0], [20, 100]) == 0
    total = WidthPlanner(objective="total", cost=dict(planner.cost), seen=dict(planner.seen))
    total.reset(2)
    total.succ, total.trials = list(planner.succ), list(planner.trials)
    assert total.plan(8, [8, 0], [20, 100]) == 8


def test_cost_interpolation_and_expected_tau():
    planner = WidthPlanner(cost={0: 1.0, 8: 3.0})
    assert planner.step_cost(4) == pytest.approx(2.0)
    assert planner.step_cost(12) == 3.0
    assert expected_tau(0.5, 2) == pytest.approx(1.75)
    with pytest.raises(FlashSpecError, match="objective"):
        WidthPlanner(objective="fastest")


@pytest.mark.parametrize("batch", [1, 3])
def test_planned_decoding_is_exact(batch):
    """Greedy with the planner equals target-only greedy: the planner only shortens drafts it
    chose from the past, so decoding stays exact (the KS gate covers sampling for any arm
    sequence, which is all a planner produces)."""
    torch.manual_seed(0)
    shape = LlamaShape(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, max_positions=256)
    model = LlamaLM(shape, 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
    for name, p in model.named_parameters():
        torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.3)
    model.eval().requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, model.shape.vocab_size, (12,), generator=g).tolist()
    prompts = [(base * 4)[: 20 + 5 * b] for b in range(batch)]
    ref = SpecEngine(model, [Arm()]).generate(prompts, 40)
    engine = SpecEngine(model, [Arm("ngram", 6)], planner=WidthPlanner(explore=1),
                        drafters=[NgramDrafter()])
    got = engine.generate(prompts, 40)
    assert [r.tokens for r in got.rows] == [r.tokens for r in ref.rows]
    widths = {len(row.accept_hist) for row in got.rows}
    assert engine.planner.seen, "the planner made no decision"
    assert max(widths) >= 2, "the planner never speculated"


def test_lookup_skipped_when_even_full_drafts_cannot_pay():
    planner = WidthPlanner(replan=1)     # plan afresh every step
    planner.reset(1)
    warm(planner, {0: 1.0, 4: 3.0, 8: 5.0}, 8)
    for _ in range(5):
        planner.observe_counts(8, 5.0, [0], [1])
    calls = []
    assert planner.plan(8, lambda: calls.append(1) or [8], [100]) == 0
    assert not calls, "the drafts were looked up although no width could pay"
    planner.cost[8] = 1.0    # drafting is now free: the lookup is needed again
    assert planner.plan(8, lambda: calls.append(1) or [8], [100]) > 0 and calls


def test_decision_is_kept_for_replan_steps_and_unmeasured_steps_are_skipped():
    """A decision holds ``replan`` steps (the cheap path still checks that drafts exist); a
    step observed without a wall time (a drafter's catch-up) leaves the cost table alone."""
    planner = WidthPlanner(replan=3)
    planner.reset(1)
    warm(planner, {0: 1.0, 4: 1.5, 8: 2.0}, 8)
    for _ in range(3):
        planner.observe_counts(8, 2.0, [8], [8])
    first = planner.plan(8, [8], [100])
    assert first == 8
    for _ in range(5):                       # drafts now always fail
        planner.observe_counts(8, 2.0, [0], [1])
    assert planner.plan(8, [0], [100]) == 0  # kept, but this step has no drafts
    assert planner.plan(8, [8], [100]) == 8  # kept
    assert planner.plan(8, [8], [100]) < 8   # replanned with the new acceptance
    before = dict(planner.cost)
    planner.observe_counts(8, None, [0], [1])
    assert planner.cost == before
