"""Bandit policies, the regret simulator, the UCB1 bound and the bandit_sim experiment."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

import flashspec.bandits as bandits
from flashspec.bandits import (EXP3, UCB1, DiscountedThompson, EpsilonGreedy, FixedArm, Oracle,
                               PerDomain, Policy, RateThompson, SharedDepthThompson,
                               SlidingWindowUCB, ThompsonSampling, reward)
from flashspec.bandits.sim import draw_rewards, env_seeds, make_scenario, simulate
from flashspec.errors import FlashSpecError
from flashspec.theory import bernoulli_kl, lai_robbins_bound, ucb1_regret_bound

ROOT = Path(__file__).resolve().parents[1]
EASY = [0.2, 0.8, 0.5]  # best arm 1
STOCHASTIC = ["eps_greedy", "ucb1", "thompson", "sw_ucb", "d_thompson", "exp3", "contextual",
              "rate_thompson", "shared"]
# Every policy class by its name (= the stem of the conf/bandit/<name>.yaml that builds it);
# tests build them with the class defaults.
POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (
    FixedArm, EpsilonGreedy, UCB1, ThompsonSampling, SlidingWindowUCB, DiscountedThompson,
    EXP3, Oracle, PerDomain, RateThompson, SharedDepthThompson)}


def _policy(name: str, n_arms: int, seeds, horizon: int, means=None):
    kw = {"fixed": {"arm": 1}, "oracle": {"means": means}, "exp3": {"horizon": horizon}}.get(name, {})
    return POLICIES[name](n_arms, seeds, **kw)


def _run(name: str, means, horizon: int, n_seeds: int = 8, change_fractions=(), seed: int = 0):
    scn = make_scenario("t", horizon, means, change_points=[round(f * horizon) for f in change_fractions])
    rewards = draw_rewards(scn, env_seeds(seed, "t", n_seeds, 0))
    policy = _policy(name, scn.n_arms, env_seeds(seed, "t", n_seeds, 1), horizon, scn.means)
    return simulate(policy, scn, rewards), scn


@pytest.mark.parametrize("name", list(POLICIES))
def test_converges_to_best_arm(name):
    res, _ = _run(name, EASY, horizon=2000)
    late = (res.arms[:, -500:] == 1).mean()
    assert late > 0.85, f"{name} plays the best arm {late:.2f} of the last 500 steps"


def test_nonstationary_policies_adapt_faster_than_ucb1():
    """The best arm degrades at T/2 (a domain shift hurts the drafter): UCB1's long history keeps
    its mean high for ~1400 steps; windowed / discounted statistics forget it quickly."""
    means, fr = [[0.8, 0.5], [0.2, 0.5]], (0.5,)
    after = {}
    for name in ("ucb1", "sw_ucb", "d_thompson"):
        res, _ = _run(name, means, horizon=4000, n_seeds=10, change_fractions=fr)
        after[name] = (res.regret[:, -1] - res.regret[:, 1999]).mean()
    assert after["sw_ucb"] < 0.5 * after["ucb1"], after
    assert after["d_thompson"] < 0.5 * after["ucb1"], after


@pytest.mark.parametrize("name", STOCHASTIC)
def test_deterministic_under_seed(name):
    a1 = _run(name, EASY, 300, n_seeds=3, seed=5)[0].arms
    a2 = _run(name, EASY, 300, n_seeds=3, seed=5)[0].arms
    a3 = _run(name, EASY, 300, n_seeds=3, seed=6)[0].arms
    assert np.array_equal(a1, a2)
    assert not np.array_equal(a1, a3)


@pytest.mark.parametrize("name", STOCHASTIC)
def test_batched_replicate_equals_scalar_policy(name):
    """Replicate r of a vectorised policy makes the scalar policy's choices for seed r."""
    seeds, horizon = [11, 22, 33], 300
    scn = make_scenario("t", horizon, EASY)
    rewards = draw_rewards(scn, [1, 2, 3])
    batched = simulate(_policy(name, 3, seeds, horizon), scn, rewards).arms
    single = _policy(name, 3, seeds[1], horizon)
    arms = []
    for t in range(horizon):
        ctx = {"step": t, "domain": None}
        a = single.select(ctx)
        single.update(a, float(rewards[1, t, a]), 1.0, ctx)
        arms.append(a)
    assert np.array_equal(batched[1], arms)


def test_oracle_and_fixed_regret_exact():
    res, scn = _run("oracle", [[0.3, 0.7], [0.9, 0.1]], 1000, change_fractions=(0.4,))
    assert np.all(res.regret == 0)
    res, _ = _run("fixed", EASY, 1000)  # arm 1 is the best arm
    assert np.all(res.regret == 0)
    fixed0 = simulate(FixedArm(3, [0, 1]), scn := make_scenario("t", 1000, EASY),
                      draw_rewards(scn, [0, 1]))
    assert np.allclose(fixed0.regret[:, -1], 0.6 * 1000)


def test_contextual_learns_each_domain():
    scn = make_scenario("d", 3000, {"code": [0.8, 0.3], "chat": [0.3, 0.8]}, seed=1)
    rewards = draw_rewards(scn, range(6))
    ctx = simulate(PerDomain(2, list(range(6))), scn, rewards)
    flat = simulate(ThompsonSampling(2, list(range(6))), scn, rewards)
    assert ctx.regret[:, -1].mean() < 0.25 * flat.regret[:, -1].mean()
    best = np.array([0 if d == "code" else 1 for d in scn.domains])
    assert (ctx.arms[:, -1000:] == best[-1000:]).mean() > 0.9
    pol = PerDomain(2, 0)
    pol.update(pol.select({"domain": "code"}), 1.0)
    assert set(pol.per_domain) == {"code"}


def test_contextual_over_two_keys_learns_each_combination():
    """Arm 0 wins only where both the domain is "edit" and the match is long: neither key alone
    separates it (by domain, edit is an even mix; by match, chat's long matches favour arm 1)."""
    rng = np.random.default_rng(0)
    means = {("edit", 4): [0.9, 0.2], ("edit", 0): [0.2, 0.9],
             ("chat", 4): [0.2, 0.9], ("chat", 0): [0.2, 0.9]}
    contexts = [list(means)[i] for i in rng.integers(0, 4, 4000)]

    def regret(policy) -> float:
        total = 0.0
        for domain, match in contexts:
            arm = policy.select({"step": 0, "domain": domain, "ngram_match": match})
            p = means[(domain, match)]
            policy.update(arm, float(rng.random() < p[arm]))
            total += max(p) - p[arm]
        return total

    both = PerDomain(2, 0, key=["domain", "ngram_match"])
    assert both.context_keys == ("domain", "ngram_match")
    assert both.label == "contextual[domain+ngram_match]"
    assert regret(both) < 0.25 * min(regret(PerDomain(2, 0, key="domain")),
                                     regret(PerDomain(2, 0, key="ngram_match")))
    assert set(both.per_domain) == set(means)
    with pytest.raises(FlashSpecError, match="distinct"):
        PerDomain(2, 0, key=["domain", "domain"])


def test_rate_thompson_estimates_pooled_rate_not_the_mean_of_step_rates():
    """Arm 0 alternates a cheap lucky step (100 tok/s for 10 ms) and a slow one (10 tok/s for
    1 s): its mean step rate is 55 but it makes 11 tokens in 1.01 s. Arm 1 always makes 30 tok/s."""
    steps = {0: [(100.0, 0.01), (10.0, 1.0)], 1: [(30.0, 0.1), (30.0, 0.1)]}
    rate, mean = RateThompson(2, 0), UCB1(2, 0, reward_scale=100.0)
    for _ in range(20):
        for arm, pairs in steps.items():
            for r, c in pairs:
                rate.update(arm, r, c)
                mean.update(arm, r, c)
    assert rate.values == pytest.approx([11.0 / 1.01, 30.0])
    assert mean.values == pytest.approx([55.0, 30.0])
    assert [rate.select() for _ in range(50)].count(1) == 50     # arm 1's sd is 0
    with pytest.raises(FlashSpecError, match="min_pulls"):
        RateThompson(2, 0, min_pulls=1)


def test_full_information_update():
    pol = UCB1(3, 0)
    for _ in range(5):
        pol.select()
        pol.update_all([1.0, None, 0.0])
    assert pol.t == 5 and pol.counts.tolist() == [5, 0, 5]
    assert pol.values.tolist() == [1.0, 0.0, 0.0]
    # full information lets Thompson settle on the best arm almost at once
    ts = ThompsonSampling(3, 0)
    rng = np.random.default_rng(0)
    for _ in range(300):
        ts.select()
        ts.update_all((rng.random(3) < np.array(EASY)).astype(float).tolist())
    assert sum(ts.select() == 1 for _ in range(50)) >= 48


def test_counts_values_costs_for_logging():
    pol = EpsilonGreedy(2, 0)
    pol.update(0, 0.5, cost=2.0)
    pol.update(0, 1.0, cost=4.0)
    pol.update(1, 0.25)
    assert pol.counts.tolist() == [2, 1]
    assert pol.values.tolist() == [0.75, 0.25]
    assert pol.mean_costs.tolist() == [3.0, 1.0]
    with pytest.raises(FlashSpecError):
        pol.update(2, 1.0)
    with pytest.raises(FlashSpecError):
        pol.update(0, 1.0, cost=0.0)
    with pytest.raises(FlashSpecError):
        UCB1(2, [0, 1]).select()


def test_policy_table_covers_every_policy_and_its_config():
    """POLICIES above holds every exported policy class, and conf/bandit/<name>.yaml builds it."""
    exported = {getattr(bandits, n) for n in bandits.__all__}
    classes = {c for c in exported if isinstance(c, type) and issubclass(c, Policy) and c is not Policy}
    assert set(POLICIES.values()) == classes
    for name, cls in POLICIES.items():
        make = instantiate(OmegaConf.load(ROOT / "conf" / "bandit" / f"{name}.yaml"))
        assert make.func is cls, name


def test_constructor_errors_are_clear():
    with pytest.raises(TypeError, match="window"):
        UCB1(3, window=10)
    with pytest.raises(FlashSpecError, match="bandit.reward"):
        UCB1(3, reward="speed")
    with pytest.raises(FlashSpecError, match="bandit.reward"):
        instantiate(OmegaConf.load(ROOT / "conf" / "bandit" / "ucb1.yaml"), reward="speed")(3, 0)
    with pytest.raises(FlashSpecError, match="reward_scale"):
        UCB1(3, reward_scale=0.0)
    with pytest.raises(FlashSpecError, match="outside"):
        FixedArm(3, arm=3)
    with pytest.raises(FlashSpecError, match="true arm means"):
        Oracle(3)
    with pytest.raises(FlashSpecError, match="inner"):
        PerDomain(3, inner=PerDomain)


@pytest.mark.parametrize("path", sorted((ROOT / "conf" / "bandit").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_bandit_config_builds(path):
    cfg = OmegaConf.load(path)
    assert cfg._target_.startswith("flashspec.bandits.") and cfg._partial_ is True
    make = instantiate(cfg)   # a partial: the runner calls it with (n_arms, seed)
    extra = {"means": [0.1, 0.2, 0.3]} if make.func is Oracle else {}
    pol = make(3, 0, **extra)
    assert isinstance(pol, Policy)
    # a choice is a policy (its file stem) or a named preset of one, e.g. contextual_tps, ngram_hit_tps
    assert pol.name == path.stem or (path.stem.endswith("_" + cfg.reward) and cfg.reward != "alpha")
    assert cfg.full_info is False
    assert pol.reward_kind == cfg.reward and pol.full_info is False
    assert pol.reward_scale == cfg.get("reward_scale", 1.0)
    context = {"step": 0, "domain": "code", "ngram_hit": True}
    arm = pol.select(context)
    pol.update(arm, 0.5 * pol.reward_scale, 1.0, context)
    assert 0 <= arm < 3 and pol.counts.sum() == 1


def test_reward_kinds():
    assert reward("alpha", 4, 3) == 0.75
    assert reward("tps", 4, 3, wall_s=0.5) == 8.0  # 3 accepted + 1 bonus token in 0.5 s
    assert reward("tps", 8, 5, wall_s=1.0, n_rows=2) == 7.0
    assert reward("accepted_per_cost", 4, 3, draft_cost=1.5) == 2.0
    for bad in (lambda: reward("alpha", 0, 0), lambda: reward("alpha", 2, 3),
                lambda: reward("tps", 4, 3), lambda: reward("accepted_per_cost", 4, 3),
                lambda: reward("speed", 4, 3)):
        with pytest.raises(FlashSpecError):
            bad()


def test_ucb1_bound_formula():
    # Auer et al. 2002, Thm 1: sum 8 ln T / gap + (1 + pi^2 / 3) sum gap
    expect = 8 * math.log(100) / 0.1 + (1 + math.pi ** 2 / 3) * 0.1
    assert ucb1_regret_bound([0.9, 0.8], 100) == pytest.approx(expect)
    assert ucb1_regret_bound([0.8, 0.9, 0.9], 100) == pytest.approx(expect)  # zero gaps drop out
    assert ucb1_regret_bound([0.5], 10_000) == 0.0
    assert ucb1_regret_bound([0.55, 0.75, 0.30], 10_000) == pytest.approx(534.94, abs=0.01)
    assert bernoulli_kl(0.3, 0.3) == 0.0 and bernoulli_kl(0.3, 0.7) > 0
    assert 0 < lai_robbins_bound([0.55, 0.75, 0.30], 10_000) < ucb1_regret_bound([0.55, 0.75, 0.30], 10_000)


def test_paper_setting_thompson_below_ucb1_below_bound():
    """T = 10,000, K = 3 (our means for the seed paper's setting), 20 seeds."""
    means = [0.55, 0.75, 0.30]
    final = {n: _run(n, means, 10_000, n_seeds=20)[0].regret[:, -1].mean() for n in ("ucb1", "thompson")}
    assert final["thompson"] < final["ucb1"] < ucb1_regret_bound(means, 10_000), final


def test_run_py_bandit_sim_smoke(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "run.py", "experiment=bandit_sim", "smoke=true", "logger=disabled",
                           f"output_dir={out}", f"hydra.run.dir={tmp_path / 'hydra'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(line) for line in (out / "bandit_sim.jsonl").read_text().splitlines()]
    regret = [r for r in recs if r["kind"] == "regret"]
    scenarios = OmegaConf.load(ROOT / "conf" / "experiment" / "bandit_sim.yaml").experiment.scenarios
    assert {r["scenario"] for r in regret} == set(scenarios)
    for r in regret:
        fracs = scenarios[r["scenario"]].get("change_fractions")
        if fracs:
            assert len(r["segment_regret_mean"]) == len(fracs) + 1
        else:
            assert "segment_regret_mean" not in r
    assert all(r["n_seeds"] >= 2 and r["provenance"]["config"]["smoke"] for r in regret)
    paper = [r for r in recs if r["kind"] == "paper_comparison"]
    assert len(paper) == 1 and paper[0]["paper"]["ucb1"] == 100.2
    assert (out / "regret.png").stat().st_size > 10_000


def test_bandit_vs_fixed_pools_tokens_over_batch_walls():
    from flashspec.metrics import bandit_vs_fixed, format_bandit_vs_fixed

    def rec(method, tokens, wall, batch):
        return {"method": method, "n_new_tokens": tokens, "wall_s": wall, "batch_id": batch}
    recs = [rec("ar", 100, 4.0, "a"), rec("spec:x@3", 100, 2.0, "x"), rec("spec:y@3", 50, 2.0, "y1"),
            rec("spec:y@3", 50, 2.0, "y2"), rec("spec:bandit:t", 60, 1.0, "b"),   # one batch of two rows:
            rec("spec:bandit:t", 60, 1.0, "b")]                                 # its wall counts once
    cmp = bandit_vs_fixed(recs)
    assert cmp["tps"] == {"spec:bandit:t": 120.0, "spec:x@3": 50.0, "ar": 25.0, "spec:y@3": 25.0}
    assert cmp["best_fixed"] == "spec:x@3" and cmp["vs_best_fixed"] == pytest.approx(2.4)
    assert cmp["vs_mean_fixed"] == pytest.approx(120.0 / 37.5)
    assert cmp["vs_best_fixed_interval"] is None   # one batch of prompts: nothing to resample
    assert bandit_vs_fixed(recs[:4]) is None
    per_prompt = [{**r, "prompt_id": f"p{i}", "turn": 0, "batch_id": f"{m}:{i}"}
                  for m, wall in (("spec:x@3", 2.0), ("spec:bandit:t", 1.0))
                  for i, r in enumerate([{"method": m, "n_new_tokens": 100, "wall_s": wall}] * 3)]
    cmp = bandit_vs_fixed(per_prompt)
    assert cmp["vs_best_fixed_interval"] == pytest.approx((2.0, 2.0))
    assert "90 % interval over the prompts (the best fixed arm picked again in each resample): " \
        "[2.000, 2.000]" in format_bandit_vs_fixed(cmp)


def test_vs_best_interval_resamples_batches_and_repicks_the_best_arm():
    """Three arms of one true rate, each batch's wall drawn with noise: the hindsight best of two
    sits above the third by chance, so the interval of "c over the best of a, b" lies mostly
    under 1 although no arm is slower; a method that is 0.9x an arm on every batch gets 0.9
    exactly; a batch of two records counts its wall once; one shared batch gives None."""
    import numpy as np
    from flashspec.metrics import vs_best_interval

    rng = np.random.default_rng(1)

    def rec(method, pid, tokens, wall, batch=None):
        return {"method": method, "prompt_id": pid, "turn": 0, "n_new_tokens": tokens,
                "wall_s": wall, "batch_id": batch or f"{method}:{pid}"}
    recs = [rec(m, f"p{i}", 100, float(rng.lognormal(0.0, 0.1)))
            for m in ("a", "b", "c") for i in range(40)]
    lo, hi = vs_best_interval(recs, "c", ["a", "b"])
    assert lo < 0.98 < hi and 0.9 < lo and hi < 1.1
    assert lo < vs_best_interval(recs, "c", ["a"])[0]     # one rival: no pick to flatter it
    slow = [rec("s", r["prompt_id"], 90, r["wall_s"]) for r in recs if r["method"] == "a"]
    assert vs_best_interval(recs + slow, "s", ["a"]) == pytest.approx((0.9, 0.9))
    pair = [rec("x", "p0", 50, 1.0, "x0"), rec("x", "p1", 50, 1.0, "x0"),   # one batch: wall once
            rec("x", "p2", 100, 1.0, "x1"), rec("y", "p0", 50, 2.0, "y0"),
            rec("y", "p1", 50, 2.0, "y0"), rec("y", "p2", 100, 2.0, "y1")]
    assert vs_best_interval(pair, "x", ["y"]) == pytest.approx((2.0, 2.0))
    assert vs_best_interval(pair[:2] + pair[3:5], "x", ["y"]) is None


def test_step_overhead_compares_a_policy_with_the_arm_it_played_alone():
    """A policy that played arm 1 on every step of p0 (10 steps in 1.1 s against the arm alone's
    20 in 2.0 s) and of p1 (packed counts: 5 steps in 0.6 s against 5 in 0.5 s) costs 1.1 and
    1.2 per step; p2, played on two arms, and p3, whose arm ran no reference, do not count."""
    from flashspec.metrics import step_overhead

    def rec(method, pid, steps, seconds, **arms):
        return {"method": method, "prompt_id": pid, "turn": 0, "steps": steps,
                "decode_s": seconds, **arms}
    alone = {0: "spec:a@3", 1: "spec:b@3"}
    recs = [rec("spec:b@3", "p0", 20, 2.0), rec("spec:b@3", "p1", 5, 0.5),
            rec("spec:a@3", "p2", 8, 0.8), rec("spec:b@3", "p2", 8, 0.8),
            rec("pol", "p0", 10, 1.1, arms=[1] * 10),
            rec("pol", "p1", 5, 0.6, arm_counts={"0": 0, "1": 5}),
            rec("pol", "p2", 8, 4.0, arms=[0, 1, 1, 1, 1, 1, 1, 1]),
            rec("pol", "p3", 8, 4.0, arms=[2] * 8)]
    cost, n = step_overhead(recs, "pol", alone)
    assert n == 2 and cost == pytest.approx(1.15)
    assert step_overhead(recs, "spec:a@3", alone) is None     # no arms: nothing to compare


def test_priced_rate_prices_each_step_at_its_arms_cost_alone():
    """A policy that took 12 steps on p0 (4 on arm 0, 8 on arm 1) in 2.0 s of decode within 2.5 s
    of wall, where arm 0 alone costs 0.1 s a step and arm 1 0.05 s: priced, 0.5 + 0.4 + 0.4 s
    for its 100 tokens; with arm 1 never played alone, or a batch of two rows, it has no price."""
    from flashspec.metrics import priced_rate

    base = {"prompt_id": "p0", "turn": 0, "n_new_tokens": 100, "batch_size": 1}
    recs = [{**base, "method": "spec:a@3", "steps": 10, "decode_s": 1.0, "wall_s": 1.2},
            {**base, "method": "spec:b@3", "steps": 20, "decode_s": 1.0, "wall_s": 1.2},
            {**base, "method": "pol", "steps": 12, "decode_s": 2.0, "wall_s": 2.5,
             "arms": [0] * 4 + [1] * 8}]
    alone = {0: "spec:a@3", 1: "spec:b@3"}
    assert priced_rate(recs, "pol", alone) == pytest.approx(100 / 1.3)
    assert priced_rate(recs[::2], "pol", alone) is None
    assert priced_rate(recs[:2] + [{**recs[2], "batch_size": 2}], "pol", alone) is None


def test_the_per_domain_oracle_plays_each_domains_fastest_fixed_arm():
    """x wins code (100 tokens in 2 s against 4 s), y wins chat (100 in 1 s against 5 s): the
    oracle decodes 200 tokens in 3 s, against x's 7 s over the run (the best fixed arm)."""
    from flashspec.metrics import bandit_vs_fixed, format_bandit_vs_fixed

    def rec(method, domain, wall, batch):
        return {"method": method, "domain": domain, "n_new_tokens": 100, "wall_s": wall,
                "batch_id": batch}
    recs = [rec("spec:x@3", "code", 2.0, "x1"), rec("spec:x@3", "chat", 5.0, "x2"),
            rec("spec:y@3", "code", 4.0, "y1"), rec("spec:y@3", "chat", 1.0, "y2"),
            rec("spec:bandit:t", "code", 2.5, "b1"), rec("spec:bandit:t", "chat", 1.5, "b2")]
    cmp = bandit_vs_fixed(recs)
    assert cmp["best_fixed"] == "spec:y@3"   # 200 tokens in 5 s, x in 7 s
    assert cmp["best_per_domain"] == {"code": "spec:x@3", "chat": "spec:y@3"}
    assert cmp["oracle_vs_best_fixed"] == pytest.approx((200 / 3) / (200 / 5))
    assert "per-domain oracle (code: spec:x@3, chat: spec:y@3) / best fixed: 1.667" \
        in format_bandit_vs_fixed(cmp)
    one = [r for r in recs if r["method"] != "spec:x@3"]
    assert bandit_vs_fixed(one)["oracle_vs_best_fixed"] == 1.0


def test_rate_thompson_does_not_lock_out_an_arm_after_two_zero_rewards():
    """The better arm starts with two zero rewards (its own variance is 0), then always pays 1;
    the other pays Bernoulli(0.5). The variance pooled over arms keeps the first arm's posterior
    open, so it is played again and wins; without the prior it is never played again."""
    def run(**kw):
        pol = RateThompson(2, 0, **kw)
        for arm, r in ((0, 0.0), (0, 0.0), (1, 0.0), (1, 1.0)):
            pol.update(arm, r)
        rng, arms = np.random.default_rng(1), []
        for _ in range(300):
            a = pol.select()
            arms.append(a)
            pol.update(a, 1.0 if a == 0 else float(rng.random() < 0.5))
        return arms
    assert run()[-100:].count(0) > 90
    assert run(prior_weight=0.0).count(0) == 0


def test_discounted_rate_thompson_does_not_force_plays_of_a_far_slower_arm():
    """Arms of 40, 30 and 12 tok/s (the last like a layer-skip drafter that rarely lands), 1,000
    steps, discount 0.99. Forcing a play whenever an arm's faded count dips under min_pulls
    tries the slow arm every ~40 steps (22 plays after step 100 on every seed); letting fading
    widen the posterior instead tries it about half as often. Arm 0 still wins most steps."""
    def run(seed: int) -> np.ndarray:
        pol, rng, arms = RateThompson(3, seed, discount=0.99), np.random.default_rng(seed + 10), []
        for _ in range(1000):
            a = pol.select()
            arms.append(a)
            pol.update(a, max((40.0, 30.0, 12.0)[a] * (1 + 0.3 * rng.standard_normal()), 0.0), 0.06)
        return np.array(arms[100:])
    for seed in range(4):
        arms = run(seed)
        assert (arms == 2).sum() <= 15
        assert (arms == 0).mean() > 0.6


def test_discounted_rate_thompson_follows_a_switch_of_the_best_arm():
    """Arm 0 makes 60 tok/s and arm 1 40 for 1,000 steps, then they swap (a stream moving from
    chat to code editing). In the 200 steps after the switch the discounted policy plays the new
    best arm most of the time on every seed; the undiscounted one, whose pooled estimates still
    favour arm 0, rarely does."""
    def share_after_switch(seed: int, **kw) -> float:
        pol, rng, arms = RateThompson(2, seed, **kw), np.random.default_rng(seed + 10), []
        for t in range(1200):
            a = pol.select()
            arms.append(a)
            mean = (60.0, 40.0)[a] if t < 1000 else (40.0, 60.0)[a]
            pol.update(a, max(mean + 8.0 * rng.standard_normal(), 0.0), 0.03)
        return arms[1000:].count(1) / 200
    seeds = range(3)
    assert min(share_after_switch(s, discount=0.98) for s in seeds) > 0.75
    assert np.mean([share_after_switch(s) for s in seeds]) < 0.3
    with pytest.raises(FlashSpecError, match="discount"):
        RateThompson(2, 0, discount=0.0)


@pytest.mark.parametrize("cls", [UCB1, ThompsonSampling, RateThompson])
def test_tps_policies_are_scale_free(cls):
    """reward: tps runs on each arm's pooled rate and its standard error, in the reward's own
    unit: the same config makes the same choices whether a step yields 60 tok/s (a 2-core CPU)
    or 6,000 (a GPU), so no reward_scale has to be tuned per machine."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(1, 5, size=(300, 3)).astype(float) + np.array([0.0, 0.6, 0.3])
    seconds = np.array([0.030, 0.034, 0.031]) * rng.uniform(0.9, 1.1, size=(300, 3))
    picks = []
    for scale in (1.0, 100.0):
        pol = cls(3, seed=5, reward="tps")
        arms = []
        for t in range(300):
            a = pol.select()
            pol.update(a, tokens[t, a] / (seconds[t, a] / scale), seconds[t, a] / scale)
            arms.append(a)
        picks.append(arms)
    assert picks[0] == picks[1]
    assert np.bincount(picks[0], minlength=3).argmax() == 1   # the most tokens per second


@pytest.mark.parametrize("cls", [UCB1, ThompsonSampling, RateThompson])
def test_tps_warm_start_moves_rate_and_evidence(cls):
    """A prior's pseudo-steps count in the rate (the stored arm's tok/s) and in its evidence: the
    warm policy times each arm once on this machine and then plays the prior's best arm, where a
    cold one must first try every arm twice."""
    pol = cls(3, seed=0, reward="tps")
    pol.warm_start([50, 50, 50], [60.0, 80.0, 55.0], [0.03, 0.035, 0.03], weight=50)
    assert pol.values == pytest.approx([60.0, 80.0, 55.0])
    if cls is not RateThompson:   # UCB1 and Thompson time each arm here first (RateStats)
        timed = []
        for _ in range(3):
            a = pol.select()
            timed.append(a)
            pol.update(a, [60.0, 80.0, 55.0][a], [0.03, 0.035, 0.03][a])
        assert sorted(timed) == [0, 1, 2]
    assert [pol.select() for _ in range(5)] == [1] * 5
    cold = cls(3, seed=0, reward="tps")
    first = []
    for _ in range(6):
        a = cold.select()
        first.append(a)
        cold.update(a, 70.0, 0.03)
    assert sorted(set(first)) == [0, 1, 2]   # min_pulls: every arm twice before any index


def test_thompson_on_tps_retries_an_arm_judged_on_one_hard_prompt():
    """Three arms (a chain of 3, a chain of 4 that commits 13 % more tokens a second, a wider
    tree); the first prompt is hard, and the better chain's fourteen steps there commit one or
    two tokens, as on a GPU bench cell where that arm then never ran again. The later prompts
    are easier, and steps of one prompt share its difficulty. Stepping every arm on its first
    three prompts and shrinking its variance towards the pooled one with 20 pseudo-steps (the
    defaults) brings it back on most of 40 seeds; with neither, it is locked out on almost all."""
    def late_steps(**kw) -> np.ndarray:
        n = 40
        pol = ThompsonSampling(3, list(range(n)), reward="tps", **kw)
        rng = np.random.default_rng(7)
        lam, cap = np.array([2.0, 2.6, 2.2]), np.array([3, 4, 5])
        cost = np.array([1.2e-3, 1.3e-3, 1.45e-3])
        first = [(1, 2), (1, 1), (2, 2), (0, 2), (0, 1), (2, 2), (2, 1), (0, 2)] \
            + [(1, 1)] * 4 + [(1, 2), (1, 1)] + [(0, 1 + k % 2) for k in range(50)] \
            + [(2, 1 + k % 2) for k in range(10)]
        for s, (a, t) in enumerate(first):
            pol.select_many({"step": s})
            arm = np.full(n, a)
            pol.update_many(arm, t / cost[arm], cost[arm], {"step": s})
        late = np.zeros(n)
        for _ in range(15):
            d = rng.uniform(0.6, 1.4, size=n)
            for s in range(60):
                arms = pol.select_many({"step": s})
                t = 1 + np.minimum(rng.poisson(lam[arms] * d), cap[arms])
                pol.update_many(arms, t / cost[arms], cost[arms], {"step": s})
                late += arms == 1
        return late
    assert (late_steps() < 20).sum() <= 12
    assert (late_steps(min_prompts=1, prior_weight=1.0) < 20).sum() >= 30
