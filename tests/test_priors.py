"""Priors that carry over: the calibration store, warm-started policies, and the decode job's
side (key, warm start, what a job writes)."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from omegaconf import OmegaConf

from experiments.harness import config_arms, make_policy
from flashspec.bandits import UCB1, EpsilonGreedy, SlidingWindowUCB, ThompsonSampling
from flashspec.bandits.priors import (ArmStats, PriorKey, Priors, arm_stats, describe_miss, pooled,
                                      load_priors, save_priors)
from flashspec.bandits.sim import draw_rewards, env_seeds, make_scenario, simulate
from flashspec.core import Arm
from flashspec.data import Prompt
from flashspec.errors import FlashSpecError
from test_configs import composed

LABELS = ["eagle@3", "eagle@2", "ngram@3"]


def key(**kw) -> PriorKey:
    base = dict(target="smollm2/float32/none", hardware="cpu", domain="code", reward="alpha",
                arms=tuple(LABELS), drafters="d0")
    return PriorKey(**{**base, **kw})


def store(means=(0.6, 0.8, 0.3), pulls=(40, 50, 30), **kw) -> Priors:
    return Priors(key(**kw), {a: ArmStats(n, m, 0.1) for a, m, n in zip(LABELS, means, pulls)})


def test_store_round_trip_and_key_checks(tmp_path):
    priors = store()
    path = save_priors(tmp_path, priors)
    assert path.name.startswith("smollm2_float32_none-cpu-code-alpha-")
    loaded = load_priors(tmp_path, key())
    assert loaded.key == priors.key and loaded.arms == priors.arms
    # the key is the set of arms: the policy's index order does not change it
    assert key(arms=tuple(reversed(LABELS))) == key()
    # another drafter set, domain or sampling: nothing stored, and the miss says what is
    assert load_priors(tmp_path, key(drafters="d1")) is None
    assert "other drafters" in describe_miss(tmp_path, key(drafters="d1"))
    assert "arms eagle@2,eagle@3,ngram@3" in describe_miss(tmp_path, key(arms=("eagle@3", "ar")))
    assert "sampling greedy" in describe_miss(tmp_path, key(sampling="T1,k0,p1"))
    assert load_priors(tmp_path, key(domain="chat")) is None
    assert "stored for the same setting" not in describe_miss(tmp_path, key(domain="chat"))
    # a file under this key's name holding another key's stats is refused, not applied
    data = json.loads(path.read_text())
    data["key"]["hardware"] = "h200"
    path.write_text(json.dumps(data))
    with pytest.raises(FlashSpecError, match="holds stats of"):
        load_priors(tmp_path, key())
    with pytest.raises(FlashSpecError, match="stats for arms"):
        Priors(key(), {"eagle@3": ArmStats(1, 0.5)})
    assert arm_stats([0.5, 1.0, 0.0], 0.2) == ArmStats(3, 0.5, 0.2)


def test_priors_are_applied_by_label_never_by_position():
    """The store's best arm is eagle@2; a policy over the same arms in another index order
    starts on eagle@2 (its index 2 here), and a policy over other arms is refused."""
    priors = store()
    order = ["ngram@3", "eagle@3", "eagle@2"]
    pulls, means, costs = priors.aligned(order)
    assert means.tolist() == [0.3, 0.6, 0.8] and pulls.tolist() == [30, 40, 50]
    policy = UCB1(3, seed=0)
    policy.bind_arms([Arm.parse(a) for a in order])
    policy.warm_start(pulls, means, costs, weight=20)
    assert policy.select() == order.index("eagle@2")
    assert policy.counts.tolist() == [20, 20, 20] and np.allclose(policy.mean_costs, 0.1)
    with pytest.raises(FlashSpecError, match="never applied to other arms"):
        priors.aligned(["ngram@3", "eagle@3", "eagle@4"])


TRUE = [0.3, 0.7, 0.5, 0.2]   # arm 1 is best


def _run(name: str, prior_means, horizon: int, n: int):
    scn = make_scenario("p", horizon, TRUE, rewards="beta", concentration=8.0)
    rewards = draw_rewards(scn, env_seeds(0, "p", n, 0))
    policy = {"ucb1": UCB1, "thompson": ThompsonSampling}[name](4, env_seeds(0, "p", n, 1))
    if prior_means is not None:
        policy.warm_start([200] * 4, prior_means, weight=20)
    return simulate(policy, scn, rewards)


@pytest.mark.parametrize("name", ["ucb1", "thompson"])
def test_warm_start_cuts_early_regret_and_still_adapts(name):
    """Priors an earlier run measured (close to the true means) more than halve the regret of
    the first 200 steps; priors naming the wrong best arm are worth 20 steps and are overcome:
    over the last 200 of 800 steps the true best arm is played about as often as cold."""
    cold = _run(name, None, 200, 16).regret[:, -1].mean()
    warm = _run(name, [0.32, 0.68, 0.5, 0.2], 200, 16).regret[:, -1].mean()
    assert warm < 0.5 * cold, (cold, warm)
    share = lambda res: (res.arms[:, -200:] == 1).mean()
    wrong, cold = share(_run(name, [0.3, 0.4, 0.75, 0.2], 800, 4)), share(_run(name, None, 800, 4))
    assert wrong > 0.8 and wrong > cold - 0.05, (wrong, cold)


@pytest.mark.parametrize("name", ["ucb1", "thompson"])
def test_a_prior_measured_on_a_faster_box_keeps_its_ranking(name):
    """Priors from a run 3x faster than this one (a CPU box's speed moves that much from day to
    day): the same tokens a step at a third of the seconds. Each arm is stepped once to time it
    here, then the policy stays on the prior's best arm. Read in the prior's seconds, every arm
    not yet played would look 3x better than the one being played, and the policy would leave
    the best arm to try them all."""
    from flashspec.bandits.rate import RateStats
    policy = (UCB1 if name == "ucb1" else ThompsonSampling)(3, seed=0, reward="tps", min_pulls=2)
    truth = np.array([30.0, 25.0, 20.0])                  # this run's tok/s, the prior's ranking
    policy.warm_start([200] * 3, 3 * truth, [0.05 / 3] * 3, weight=200)
    rng = np.random.default_rng(0)
    picks = []
    for _ in range(60):
        arm = policy.select()
        picks.append(arm)
        policy.update(arm, truth[arm] * rng.uniform(0.8, 1.2), 0.05)
    assert sorted(picks[:3]) == [0, 1, 2], picks          # each timed once
    assert np.mean(np.array(picks[3:]) == 0) > 0.9, picks
    assert policy.rates.rate()[0] == pytest.approx(truth, rel=0.1)
    # an arm not played yet is read at the prior's step time scaled by the played arms' ratio
    stats = RateStats((1, 2))
    stats.seed(np.array([10.0, 10.0]), np.array([90.0, 60.0]), np.array([0.1, 0.1]))
    assert stats.rate()[0].tolist() == pytest.approx([90.0, 60.0])   # nothing observed yet
    stats.observe(np.array([[45.0, np.nan]]), np.array([[0.2, np.nan]]))
    assert stats.step_cost()[0].tolist() == pytest.approx([0.2, 0.2])
    assert stats.unmeasured()[0].tolist() == [False, True]
    assert stats.rate()[0].tolist() == pytest.approx([(9.0 + 90.0) / 2.2, 30.0])


@pytest.mark.parametrize("name", ["ucb1", "thompson"])
def test_a_prior_from_a_machine_whose_costs_rank_the_arms_otherwise_is_corrected(name):
    """Tokens a step carry over from another machine, step times do not: on the prior's box
    arm 1 (more tokens a step at about the same cost) was the faster; here its steps cost a
    third more than arm 0's and arm 0 is. After one timed step of each, the policy ranks them by
    the prior's tokens over this machine's seconds and settles on arm 0, where a prior read in
    its own tok/s (or one speed factor for every arm) would hold it on arm 1."""
    policy = (UCB1 if name == "ucb1" else ThompsonSampling)(2, seed=0, reward="tps", min_pulls=2)
    tokens = np.array([2.3, 2.7])                         # committed tokens a step (acceptance)
    policy.warm_start([400, 400], tokens / [0.065, 0.064], [0.065, 0.064], weight=10)
    cost = np.array([0.060, 0.080])                       # this machine: arm 0 the faster
    rng = np.random.default_rng(1)
    picks = []
    for _ in range(80):
        arm = policy.select()
        picks.append(arm)
        step_tokens = 1 + rng.binomial(3, (tokens[arm] - 1) / 3)
        policy.update(arm, step_tokens / cost[arm], cost[arm])
    assert np.mean(np.array(picks[-60:]) == 0) > 0.8, picks


@pytest.mark.parametrize("name", ["ucb1", "thompson"])
def test_an_arm_whose_timing_step_read_slow_is_not_held_out_by_its_prior(name):
    """Each prior-backed arm is stepped once to time it, and that step's seconds price all of its
    pseudo-steps (200 here). Arm 1 is the fastest here, but its first step took 1.7x its usual
    time: read as certain, its rate stays under arm 0's and it is never stepped again (UCB1 did
    this on a CPU box). The spread also carries the error of the arm's mean step time here, from
    its own few steps (widened while they are few), so the arm is stepped again and the policy
    settles on it. Over 20 streams at most 2 lock out; with the pooled error alone (no
    widening) 13 of 20 did for UCB1 and 14 for Thompson sampling."""
    locked = 0
    for seed in range(20):
        policy = (UCB1 if name == "ucb1" else ThompsonSampling)(3, seed=0, reward="tps",
                                                                  min_pulls=2)
        tokens = np.array([2.5, 2.2, 2.6])                # committed tokens a step (the prior's)
        cost = np.array([0.080, 0.055, 0.090])            # this machine: arm 1 the fastest
        policy.warm_start([200] * 3, tokens / 0.065, [0.065] * 3, weight=200)
        rng = np.random.default_rng(seed)
        picks = []
        for _ in range(300):
            arm = policy.select()
            slow = 1.7 if arm == 1 and 1 not in picks else 1.0
            picks.append(arm)
            seconds = cost[arm] * rng.normal(1.0, 0.1) * slow
            policy.update(arm, (1 + rng.binomial(3, (tokens[arm] - 1) / 3)) / seconds, seconds)
        locked += np.mean(np.array(picks[-100:]) == 1) < 0.5
    assert locked <= 2, f"{locked} of 20 streams never settled on the fastest arm"


def test_warm_start_guards():
    policy = UCB1(3, seed=[0, 1])
    policy.warm_start([5, 50, 0], [0.5, 0.6, 0.7], weight=20)
    assert policy.counts.tolist() == [[5, 20, 0]] * 2
    assert (policy.select_many() == 2).all()          # an arm without priors is played first
    policy.update_many(np.array([2, 2]), np.array([0.7, 0.7]))
    with pytest.raises(FlashSpecError, match="after 1 updates"):
        policy.warm_start([1, 1, 1], [0.5] * 3)
    with pytest.raises(FlashSpecError, match="one per arm"):
        UCB1(3).warm_start([1, 1], [0.5, 0.5])
    with pytest.raises(FlashSpecError, match="does not start from priors"):
        SlidingWindowUCB(3).warm_start([1, 1, 1], [0.5] * 3)
    t = ThompsonSampling(2, reward_scale=2.0)
    t.warm_start([10, 10], [1.5, 0.5], weight=20)
    assert np.allclose(t.posterior_means, [(1 + 7.5) / 12, (1 + 2.5) / 12])
    e = EpsilonGreedy(2, epsilon=0.0)
    e.warm_start([3, 3], [0.2, 0.9])
    assert e.select() == 1


def _prompts(*domains: str) -> list[Prompt]:
    return [Prompt(id=f"p{i}", dataset="x", domain=d, category=d, turns=["hi"])
            for i, d in enumerate(domains)]


def test_decode_job_warm_starts_from_its_key_only(tmp_path, caplog):
    """experiments/priors.py: the job's key (target, hardware, drafters, sampling, domain,
    reward) finds the store a job of the same setting wrote; a mixed-domain run, another head,
    priors.use=false, a policy that takes no priors and one set cold start cold, each saying so."""
    from experiments import priors as carried
    cfg = composed("bandit=ucb1", f"priors.path={tmp_path}")
    labels = [a.label for a in config_arms(cfg.drafters)]
    k = carried.prior_key(cfg, labels, "code", "alpha")
    assert k.target == "smollm2/float32/none" and k.hardware == "cpu" and k.sampling == "greedy"
    # a batch's step costs more than one row's: rates at B = 4 are another setting
    assert carried.prior_key(composed("experiment.batch_size=4"), labels, "code",
                             "alpha").sampling == "greedy,B4"
    assert carried.prior_key(composed("head.rank=d/16"), labels, "code", "alpha").drafters \
        != k.drafters
    means = np.linspace(0.3, 0.9, len(labels))
    save_priors(tmp_path, Priors(k, {a: ArmStats(30, float(m)) for a, m in zip(labels, means)}))
    caplog.set_level(logging.INFO)
    policy = UCB1(len(labels), seed=0)
    used = carried.warm_start(cfg, [policy], labels, _prompts("code", "code"))
    assert list(used) == ["ucb1"] and policy.select() == len(labels) - 1
    for c, prompts, policy, said in [
            (cfg, _prompts("code", "chat"), UCB1(len(labels)), "domain chat"),  # not pooled
            (composed("head.rank=d/16", f"priors.path={tmp_path}"), _prompts("code"),
             UCB1(len(labels)), "other drafters"),
            (composed(f"priors.path={tmp_path}", "priors.use=false"), _prompts("code"),
             UCB1(len(labels)), "start cold"),
            (cfg, _prompts("code"), SlidingWindowUCB(len(labels)), "does not start from"),
            (cfg, _prompts("code"), make_policy(OmegaConf.create(
                {"_target_": "flashspec.bandits.UCB1", "_partial_": True, "cold": True}),
                len(labels), 0), "is set cold")]:
        caplog.clear()
        assert carried.warm_start(c, [policy], labels, prompts) == {}
        assert policy.counts.sum() == 0 and said in caplog.text, caplog.text


def test_a_policy_keyed_on_the_domain_starts_each_domain_from_its_own_priors(tmp_path, caplog):
    """A mixed stream's contexts start from their domain's store file: code favours the last
    arm, chat the first, in every n-gram-match context; a domain without a file starts cold;
    priors after the first update are refused."""
    from experiments import priors as carried
    from flashspec.bandits import PerDomain
    cfg = composed("bandit=ucb1", f"priors.path={tmp_path}")
    labels = [a.label for a in config_arms(cfg.drafters)]
    for domain, means in (("code", np.linspace(0.3, 0.9, len(labels))),
                          ("chat", np.linspace(0.9, 0.3, len(labels)))):
        save_priors(tmp_path, Priors(carried.prior_key(cfg, labels, domain, "alpha"),
                                     {a: ArmStats(30, float(m)) for a, m in zip(labels, means)}))
    policy = PerDomain(len(labels), seed=0, inner=UCB1, key=["domain", "ngram_match"])
    caplog.set_level(logging.INFO)
    used = carried.warm_start(cfg, [policy], labels, _prompts("code", "chat", "math"))
    assert list(used) == [policy.label] and used[policy.label].count(".json") == 2
    assert "starts cold on math" in caplog.text
    for match in (0, 3):
        assert policy.select({"domain": "code", "ngram_match": match}) == len(labels) - 1
        assert policy.select({"domain": "chat", "ngram_match": match}) == 0
    assert policy.per_domain == {}   # seeded, not yet updated
    policy.update(0, 1.0, context={"domain": "chat", "ngram_match": 0})
    with pytest.raises(FlashSpecError, match="first update"):
        policy.warm_start_domain("math", [1] * len(labels), [0.5] * len(labels))
    with pytest.raises(FlashSpecError, match="keyed on the domain"):
        PerDomain(2, inner=UCB1, key="ngram_match").warm_start_domain("code", [1, 1], [0.5, 0.5])


def test_a_policy_blind_to_the_domain_starts_from_every_domain_pooled(tmp_path, caplog):
    """On a mixed stream a policy not keyed on the domain starts from the domains' files
    pooled as the stream's mixture: tps means weighted by seconds (pulls x cost), so the
    pooled rate is tokens over seconds across both files, not the mean of the two rates."""
    from experiments import priors as carried
    cfg = composed("bandit=ucb1", f"priors.path={tmp_path}", "priors.weight=20")
    labels = [a.label for a in config_arms(cfg.drafters)]
    k = len(labels)
    files = {"code": (np.full(k, 30.0), np.linspace(10, 40, k), np.full(k, 0.1)),
             "chat": (np.full(k, 10.0), np.linspace(40, 10, k), np.full(k, 0.2))}
    for domain, (n, m, c) in files.items():
        save_priors(tmp_path, Priors(carried.prior_key(cfg, labels, domain, "tps"),
                                     {a: ArmStats(int(n[i]), float(m[i]), float(c[i]))
                                      for i, a in enumerate(labels)}))
    pulls, means, costs = pooled(list(files.values()), "tps")
    seconds = {d: n * c for d, (n, _, c) in files.items()}
    tokens = sum(m * seconds[d] for d, (_, m, _) in files.items())
    np.testing.assert_allclose(means, tokens / (seconds["code"] + seconds["chat"]))
    np.testing.assert_allclose(pulls, 40.0)
    np.testing.assert_allclose(costs, (30 * 0.1 + 10 * 0.2) / 40)
    assert means[-1] > means[0]   # code's 3 s outweigh chat's 2 s
    # α (no seconds in it) pools by steps
    np.testing.assert_allclose(pooled(list(files.values()), "alpha")[1],
                               (30 * files["code"][1] + 10 * files["chat"][1]) / 40)
    policy = make_policy(OmegaConf.create({"_target_": "flashspec.bandits.UCB1",
                                           "_partial_": True, "reward": "tps"}), k, 0)
    caplog.set_level(logging.INFO)
    used = carried.warm_start(cfg, [policy], labels, _prompts("code", "chat"))
    assert used[policy.label].count(".json") == 2 and "chat+code pooled" in caplog.text
    np.testing.assert_allclose(policy.counts[0], 20.0)   # priors.weight caps each arm


def test_decode_job_writes_what_each_arm_measured(tmp_path):
    """Each arm's stats come from its records played alone; an arm the job did not play alone
    gets the steps the policy's method played it (arms and rewards aligned)."""
    from experiments import priors as carried
    rec = lambda method, domain, arms, rewards, steps=4, s=0.4: {
        "method": method, "domain": domain, "arms": arms, "rewards": rewards, "steps": steps,
        "decode_s": s}
    records = [rec("spec:a@2", "code", [0, 0], [1.0, 0.5]), rec("spec:a@2", "code", [0], [0.0]),
               rec("spec:a@2", "chat", [0], [0.25]),
               rec("spec:bandit:ucb1", "code", [0, 1, 1], [0.9, 0.2, 0.4])]
    out = carried.measured(records, ["a@2", "n@3"], {0: "spec:a@2"}, "spec:bandit:ucb1")
    assert out["code"]["a@2"] == ArmStats(3, 0.5, 0.1)
    # a tok/s prior of an arm played alone is its pooled rate, tokens / seconds, not the mean of
    # per-step tok/s (biased up by cheap lucky steps)
    tps = [{**r, "n_new_tokens": 6, "rewards": [40.0, 5.0] if r["domain"] == "code" else [1.0]}
           for r in records[:3]] + records[3:]
    rate = carried.measured(tps, ["a@2", "n@3"], {0: "spec:a@2"}, "spec:bandit:ucb1", "tps")
    assert rate["code"]["a@2"] == ArmStats(4, 12 / 0.8, 0.1)
    # a method that plays the arm alone without a policy (experiment=bench) keeps no per-step
    # rewards: the rate and its steps come from the records' totals
    bare = [{k: v for k, v in r.items() if k != "rewards"} for r in tps[:3]]
    assert carried.measured(bare, ["a@2", "n@3"], {0: "spec:a@2"}, None, "tps")["code"]["a@2"] \
        == ArmStats(8, 12 / 0.8, 0.1)
    assert out["code"]["n@3"].pulls == 2 and out["code"]["n@3"].mean == pytest.approx(0.3)
    assert out["chat"]["a@2"] == ArmStats(1, 0.25, 0.1) and out["chat"]["n@3"].pulls == 0
    cfg = composed("bandit=ucb1", f"priors.save={tmp_path / 'store'}")
    written = carried.save(cfg, records, ["a@2", "n@3"], {0: "spec:a@2"}, "spec:bandit:ucb1",
                           "alpha", tmp_path / "run")
    assert len(written) == 4 and all(p.endswith(".json") for p in written)
    assert len(list((tmp_path / "run" / "priors").glob("*.json"))) == 2
    smoke = composed("smoke=true", f"priors.save={tmp_path / 'smoke_store'}")
    assert len(carried.save(smoke, records, ["a@2", "n@3"], {0: "spec:a@2"}, None, "alpha",
                            tmp_path / "smoke_run")) == 2      # the run's own directory only
    assert not (tmp_path / "smoke_store").exists()


def test_greedy_decoding_under_a_warm_started_policy_equals_the_target():
    """The engine under a policy started from priors: its first pick is the priors' best arm
    (not the cold policy's round of every arm), and greedy output is still the target's."""
    from flashspec.drafters import ModelDrafter, NgramDrafter
    from flashspec.engine import SpecEngine
    from flashspec.models import load_model
    model, _ = load_model("dummy:smollm2-135m", dtype="float32", seed=0)
    drafters = [NgramDrafter(max_ngram=2), ModelDrafter(model, [0], name="skip1")]
    arms = [Arm.parse(a) for a in ("ngram@2", "skip1@2", "skip1@3")]
    prompts = [[1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [9, 9, 9, 9, 10]]
    ar = SpecEngine(model, [Arm()]).generate(prompts, 12).rows
    priors = Priors(key(arms=("ngram@2", "skip1@2", "skip1@3")),
                    {"ngram@2": ArmStats(30, 0.2), "skip1@2": ArmStats(30, 0.3),
                     "skip1@3": ArmStats(30, 0.9)})
    policy = UCB1(len(arms), seed=0)
    policy.warm_start(*priors.aligned([a.label for a in arms]), weight=20)
    rows = SpecEngine(model, arms, policy, drafters=drafters).generate(prompts, 12).rows
    assert [r.tokens for r in rows] == [r.tokens for r in ar]
    assert rows[0].arms[0] == 2 and policy.t > 0
