"""experiment=bench end to end at smoke size on the CPU: every named method decodes the same
prompt beside the reference AR, reproduces it token for token (greedy), and the job metrics
carry each method's speedups; a method's own runtime, bandit and planner reach its engine, and a
bad entry fails at composition."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

from experiments.harness import bench_method, engine_options, validate
from flashspec.core import SamplingParams
from flashspec.errors import FlashSpecError

ROOT = Path(__file__).resolve().parents[1]


def composed(*overrides: str):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=bench", *overrides],
                      return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        cfg.output_dir = "/tmp/unused"
    return cfg


def test_bench_smoke_every_method_equals_ar(tmp_path):
    """`run.py experiment=bench smoke=true` plus an AR on the resident loop (a method's own
    runtime): one record per method, every greedy_equal 1.0, speedups for every method."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "HYDRA_FULL_ERROR": "0"}
    res = subprocess.run([sys.executable, "run.py", "experiment=bench", "smoke=true",
                          "logger=disabled", f"hydra.run.dir={tmp_path}",
                          "+experiment.methods.ar_resident={arms: [[ar, 0]], runtime: resident}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    methods = ["ar", "chain_g4", "chain_g3", "tree", "tree_planner", "bandit", "ar_resident"]
    assert sorted(r["method"] for r in records) == sorted(methods)
    assert len({r["prompt_id"] for r in records}) == 1 and {r["turn"] for r in records} == {0}
    assert all(r["provenance"]["config"]["experiment"]["name"] == "bench" for r in records)
    gamma = {r["method"]: r["gamma"] for r in records}
    assert (gamma["ar"], gamma["chain_g4"], gamma["chain_g3"]) == (0, 4, 3)
    job = json.loads((tmp_path / "job_metrics.json").read_text())
    for m in methods[1:]:
        assert job[f"{m}/greedy_equal"] == 1.0, (m, job.get(f"{m}/greedy_equal"))
        assert {f"{m}/speedup", f"{m}/speedup_pooled", f"{m}/tps"} <= set(job), m
    assert job["chain_g4/tau"] > 1 and job["tree/tau"] > 1
    best = max(("chain_g3", "chain_g4", "tree"), key=lambda m: job[f"{m}/tps"])   # bandit's arms
    assert job["bandit/best_fixed"] == best
    assert job["bandit/vs_best_fixed"] == pytest.approx(job["bandit/tps"] / job[f"{best}/tps"])
    assert "tree_planner/vs_best_fixed" not in job   # one arm: nothing to compare with
    # the learning method's priors: each of its arms measured by the method playing it alone
    (stored,) = [json.loads(p.read_text()) for p in (tmp_path / "priors").glob("*.json")]
    assert stored["key"]["reward"] == "tps" and stored["key"]["domain"] == "code"
    tree_label = (set(stored["arms"]) - {"eagle_v5@3", "eagle_v5@4"}).pop()
    for m, label in [("chain_g3", "eagle_v5@3"), ("chain_g4", "eagle_v5@4"), ("tree", tree_label)]:
        recs = [r for r in records if r["method"] == m]
        rate = sum(r["n_new_tokens"] for r in recs) / sum(r["decode_s"] for r in recs)
        assert stored["arms"][label]["mean"] == pytest.approx(rate), (m, stored)


def test_a_methods_own_choices_reach_its_engine():
    """runtime by option name or merged keys, planner by name, bandit over several arms."""
    cfg = composed()
    params = SamplingParams()
    ar = bench_method(cfg, "ar", cfg.experiment.methods.ar)
    assert not engine_options(cfg, params, [], ar.runtime)["resident"]   # hardware=cpu: eager
    res = bench_method(cfg, "r", OmegaConf.create({"arms": [["ar", 0]], "runtime": "resident"}))
    kw = engine_options(cfg, params, [], res.runtime)
    assert kw["resident"] and kw["graphs"] and kw["backend"].name == "triton"
    merged = bench_method(cfg, "m", OmegaConf.create({"arms": [["ar", 0]],
                                                      "runtime": {"resident_chunk": 3}}))
    assert merged.runtime.name == "eager" and merged.runtime.resident_chunk == 3
    tree = cfg.experiment.methods
    assert bench_method(cfg, "tree", tree.tree).planner is None
    assert bench_method(cfg, "tp", tree.tree_planner).planner is not None
    two = bench_method(cfg, "ucb", OmegaConf.create({"arms": [["eagle_v5", 4], ["ar", 0]],
                                                     "bandit": "ucb1"}))
    assert two.policy is not None and two.policy.n_arms == 2 and two.policy.learns


@pytest.mark.parametrize("override,needle", [
    ("+experiment.methods.x={arms: [[nope, 4]]}", "experiment.methods.x: arm nope@4 names drafter"),
    ("+experiment.methods.x={arms: [[eagle_v5, 4]], runtime: fast}",
     "runtime=fast: no conf/runtime/fast.yaml"),
    ("+experiment.methods.x={arms: [[eagle_v5, 4]], gamma: 4}",
     "experiment.methods.x: give arms"),
    ("experiment.methods.ar=null", "needs a method named ar"),
])
def test_bad_method_entries_fail_at_composition(override, needle):
    with pytest.raises(FlashSpecError, match=needle.replace("[", r"\[")):
        validate(composed(override))


def test_an_arm_alone_is_played_as_the_method_plays_it():
    """vs_best_fixed and the priors store measure each arm of a several-arm method by the first
    one-arm method with its runtime and planner: a faster planner method over the same arm is
    not the arm alone (it made the bandit's best_fixed depend on which ran faster)."""
    from experiments.decode import Plan, arms_played_alone, bench_vs_best_fixed
    named_arms = {"g3": ["d@3"], "tree": ["d@t"], "tree_planner": ["d@t"], "tree_b": ["d@t"],
                  "bandit": ["d@3", "d@t"], "bandit_graphed": ["d@3", "d@t"]}
    plays = {"g3": ("r", False), "tree": ("r", False), "tree_planner": ("r", True),
             "tree_b": ("r", False), "bandit": ("r", False), "bandit_graphed": ("g", False)}
    alone = arms_played_alone(named_arms, plays)
    assert alone == {"bandit": {0: "g3", 1: "tree"}, "bandit_graphed": {}}
    plan = Plan(methods=[], policy_arms=[], named=list(named_arms), named_arms=named_arms,
                named_alone=alone)
    job = {"g3/tps": 10.0, "tree/tps": 12.0, "tree_planner/tps": 20.0, "tree_b/tps": 30.0,
           "bandit/tps": 11.0, "bandit_graphed/tps": 9.0}
    out = bench_vs_best_fixed(job, plan, records=[])   # no batches: no interval
    assert out == {"bandit/best_fixed": "tree", "bandit/vs_best_fixed": pytest.approx(11 / 12),
                   "bandit/vs_best_fixed_p05": None, "bandit/vs_best_fixed_p95": None}
