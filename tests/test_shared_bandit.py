"""Shared per-depth selection (flashspec.bandits.shared): what one chain step reveals about every
γ of its drafter, the regret it saves against independent arms, and exact decoding under it."""
from __future__ import annotations

import numpy as np
import pytest

from flashspec.bandits import (UCB1, SharedDepthThompson, StepOutcome,
                               ThompsonSampling)
from flashspec.bandits.shared import depth_counts, expected_accepted
from flashspec.bandits.sim import draw_chains, env_seeds, make_chain_scenario, simulate_chains
from flashspec.core import Arm, TreeShape
from flashspec.errors import FlashSpecError

CHAIN = [Arm("d", g) for g in (1, 2, 3, 4)]


def _step(policy: SharedDepthThompson, arm: int, tried: int, accepted: int, **kw) -> None:
    policy.update(arm, accepted / max(tried, 1), 1.0,
                  {"step": 0, "outcome": StepOutcome(np.array([[tried]]), np.array([[accepted]]),
                                                     **kw)})


def test_one_chain_step_reveals_every_shorter_depth():
    """A chain of γ = 4 with n accepted: depths 1..n accepted, depth n + 1 rejected, deeper
    depths unseen; a chain that accepts everything reached every depth it had."""
    for n, reached, won in [(0, [1, 0, 0, 0], [0, 0, 0, 0]), (2, [1, 1, 1, 0], [1, 1, 0, 0]),
                            (3, [1, 1, 1, 1], [1, 1, 1, 0]), (4, [1, 1, 1, 1], [1, 1, 1, 1])]:
        r, w = depth_counts(np.array([[4]]), np.array([[n]]), 4)
        assert r[0].tolist() == reached and w[0].tolist() == won, n
    # rows add up; a row that verified nothing (finished, no drafts) tells nothing
    r, w = depth_counts(np.array([[2, 4, 0]]), np.array([[2, 1, 0]]), 4)
    assert r[0].tolist() == [2, 2, 0, 0] and w[0].tolist() == [2, 1, 0, 0]
    # through the policy: one step of the γ = 4 arm and one of the γ = 2 arm feed the drafter
    policy = SharedDepthThompson(len(CHAIN), 0, arms=CHAIN, prior_alpha=1.0, prior_beta=1.0)
    _step(policy, 3, 4, 2)
    _step(policy, 1, 2, 2)
    assert policy.depth_rates["d"] == [3 / 4, 3 / 4, 1 / 3, 1 / 2]   # Beta(1 + won, 1 + lost)
    # the γ = 1 arm was never played, yet its predicted α is the drafter's depth-1 rate
    assert policy.values[0] == pytest.approx(3 / 4)
    assert policy.values[2] == pytest.approx((3 / 4 + 9 / 16 + 9 / 16 / 3) / 3)


def test_expected_accepted_is_the_sum_of_survival_products():
    assert expected_accepted(np.array([0.5, 0.5, 1.0])).tolist() == [0.0, 0.5, 0.75, 1.0]
    alphas = [0.9, 0.8, 0.7]   # the simulated chains accept that many drafts on average
    scn = make_chain_scenario("c", 200_000, {"d": alphas}, [("d", 3)], reward_kind="alpha")
    assert draw_chains(scn, [1])[0, :, 0].mean() == pytest.approx(0.9 + 0.72 + 0.504, abs=0.01)
    assert scn.arm_means[0] == pytest.approx((0.9 + 0.72 + 0.504) / 3)


def test_outcomes_are_checked_and_trees_learn_on_their_own():
    arms = [Arm("d", 2), Arm("d", tree=TreeShape.parse("3x1x1")), Arm()]
    policy = SharedDepthThompson(3, 0, arms=arms, reward="tps", reward_scale=5.0)
    with pytest.raises(FlashSpecError, match="outcome"):
        policy.update(0, 1.0, 1.0, {"step": 0})
    with pytest.raises(FlashSpecError, match="accepted <= tried"):
        _step(policy, 0, 3, 1)           # more drafts than the γ = 2 arm has
    _step(policy, 1, 3, 3)               # the tree: its own rates, not its drafter's chain
    assert policy.depth_rates == {"d": [0.5, 0.5, 0.5], "d@3x1x1": [2 / 3, 2 / 3, 2 / 3]}
    _step(policy, 1, 2, 1, chain=True)   # the tree arm cut to a chain by the planner
    assert policy.depth_rates["d"] == [2 / 3, 1 / 3, 0.5]
    policy.update(2, 3.0, 0.5, {"step": 1})   # the plain step needs no outcome
    with pytest.raises(FlashSpecError, match="rebound"):
        policy.bind_arms(arms[::-1])
    with pytest.raises(FlashSpecError, match="bandit.reward"):
        SharedDepthThompson(3, reward="accepted_per_cost")


def test_unplayed_arm_borrows_cost_from_its_drafters_chains():
    arms = [Arm("d", g) for g in (1, 2, 3)] + [Arm("e", 3)]
    policy = SharedDepthThompson(4, 0, arms=arms, reward="tps")
    for arm, cost in [(0, 1.1), (2, 1.3)]:
        policy.update(arm, 1.0, cost, {"outcome": StepOutcome(np.array([[arms[arm].gamma]]),
                                                              np.array([[0]]))})
    cost = policy.arm_costs()[0]
    assert cost[1] == pytest.approx(1.2)   # on the line through its drafter's γ = 1 and 3
    assert cost[3] == pytest.approx(1.3)   # another drafter's γ = 3


# One drafter at γ = 1..8 with falling per-depth acceptance; each drafted token costs a tenth of
# a target step, so the best γ (4, closely followed by 5) is interior and the gaps are small.
ALPHAS = [0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5]
GAMMAS = list(range(1, 9))
COSTS = [1.0 + 0.1 * g for g in GAMMAS]


def test_shared_regret_far_below_independent_arms():
    """On tokens per second, sharing per-depth evidence across the γ arms of one drafter cuts
    the regret at T = 1500 by far more than 5x against Thompson sampling and UCB1 that learn
    every arm on its own (both told the reward range), on three seeds of eight replicates."""
    horizon = 1500
    scn = make_chain_scenario("chain", horizon, {"d": ALPHAS}, [("d", g) for g in GAMMAS], COSTS)
    assert scn.arm_means.argmax() == 3
    scale = max((1 + g) / c for g, c in zip(GAMMAS, COSTS))
    for base in (0, 1, 2):
        runs = draw_chains(scn, env_seeds(base, "chain", 8, 0))
        seeds = env_seeds(base, "chain", 8, 1)
        regret = {cls.name: simulate_chains(cls(len(GAMMAS), seeds, reward="tps",
                                                reward_scale=scale), scn, runs).regret[:, -1].mean()
                  for cls in (SharedDepthThompson, ThompsonSampling, UCB1)}
        assert regret["shared"] < 0.2 * min(regret["thompson"], regret["ucb1"]), (base, regret)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_engine import load_small_model
    model, tok = load_small_model(tmp_path_factory, n_layers=2)
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       return_dict=True)["input_ids"]
               for t in ("Count: one two three one two three", "The quick brown fox")]
    return model, prompts


@pytest.mark.slow
@pytest.mark.parametrize("planned", [False, True])
def test_greedy_decoding_under_the_shared_policy_equals_the_target(tiny, planned):
    """Greedy speculative decoding is the target's greedy decoding whatever the policy plays;
    the policy learned from the engine's step outcomes (per-depth counts grew) over chains of
    two drafters at several γ and an n-gram tree, with and without the width planner cutting
    the chosen arm (a tree played as a chain of its drafter included); the captured stepper
    gives it the same per-step outcomes in chunks of one step, and refuses longer chunks (they
    report chunk totals, not each step's accepted drafts)."""
    from flashspec.drafters import ModelDrafter, NgramDrafter
    from flashspec.engine import SpecEngine
    from flashspec.planner import WidthPlanner
    model, prompts = tiny
    ngram, skip = NgramDrafter(max_ngram=2), ModelDrafter(model, [0], name="skip1")
    arms = [Arm.parse(a) for a in ("ngram@1", "ngram@3", "ngram@2x1x1", "skip1@1", "skip1@2", "ar")]
    ar = SpecEngine(model, [Arm()]).generate(prompts, 24).rows
    policy = SharedDepthThompson(len(arms), 0, reward="tps", reward_scale=200.0)
    engine = SpecEngine(model, arms, policy, planner=WidthPlanner() if planned else None,
                        drafters=[ngram, skip])
    rows = engine.generate(prompts, 24).rows
    assert [r.tokens for r in rows] == [r.tokens for r in ar]
    assert policy.t > 0 and policy._reach.sum() > 0
    assert set(policy.depth_rates) == {"ngram", "ngram@2x1x1", "skip1"}
    policy = SharedDepthThompson(len(arms), 0, reward="tps", reward_scale=200.0)
    engine = SpecEngine(model, arms, policy, planner=WidthPlanner() if planned else None,
                        drafters=[ngram, skip], resident=True, chunk=1)
    engine.min_capacity = 64
    assert [r.tokens for r in engine.generate(prompts, 24).rows] == [r.tokens for r in ar]
    assert policy.t > 0 and policy._reach.sum() > 0
    with pytest.raises(FlashSpecError, match="resident_chunk=1"):
        SpecEngine(model, arms, SharedDepthThompson(len(arms), 0, reward="tps"), resident=True,
                   chunk=2, drafters=[ngram, skip])
