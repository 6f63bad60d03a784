"""Records reused across the jobs of one multirun (experiments/decode.py) and the sweep's
progress lines (experiments/callbacks.py): keys change with exactly what decides a method's
records, and the design card's sweep, run small, copies only what no swept setting touches."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import job_config as composed
from experiments.callbacks import count_jobs
from experiments.decode import Method, arm_key, reuse_key, run_key
from flashspec.data import Prompt

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
PROMPTS = [Prompt("he/0", "humaneval", "code", "code", ["def f(x):"])]


def key(cfg, method: Method, prompts=PROMPTS, max_new: int = 128, scope: str = "/sweep") -> str:
    return reuse_key(scope, run_key(cfg, prompts, max_new), method)


def arm(cfg, drafter: str = "eagle_lr72", gamma: int = 3, full_head: bool = False) -> Method:
    return Method(f"spec:{drafter}@{gamma}", None, arm_key(cfg, drafter, gamma, "alpha", full_head))


def test_keys_follow_what_decides_the_records():
    base = composed()
    ar = Method("ar", None, {"kind": "ar"})
    # the swept axes of the design card: AR, prompt lookup and the full head touch neither
    for other in (composed("bandit=thompson"), composed("head.rank=d/16"),
                  composed("bandit=ucb1", "head.rank=d/16", "experiment.timing_iters=3")):
        assert key(other, ar) == key(base, ar)
        assert key(other, arm(other, "ngram")) == key(base, arm(base, "ngram"))
        assert key(other, arm(other, full_head=True)) == key(base, arm(base, full_head=True))
    # the drafter with the run's head: the bandit does not touch it, the head rank does
    assert key(composed("bandit=thompson"), arm(composed("bandit=thompson"))) == key(base, arm(base))
    d16 = composed("head.rank=d/16")
    assert key(d16, arm(d16)) != key(base, arm(base))
    assert key(base, arm(base, gamma=2)) != key(base, arm(base))
    # what every method's records depend on
    for other in (composed("seed=1"), composed("dataset.max_new_tokens=64"),
                  composed("experiment.temperature=0.7"), composed("dataset=gsm8k"),
                  composed("target.dtype=bfloat16"), composed("experiment.batch_size=2")):
        assert key(other, ar) != key(base, ar), other
    assert key(base, ar, max_new=8) != key(base, ar)
    assert key(base, ar, prompts=[Prompt("he/0", "humaneval", "code", "code", ["def g(x):"])]) \
        != key(base, ar)
    assert key(base, ar, scope="/other_sweep") != key(base, ar)
    # a policy's method is never reused; a checkpoint is keyed by its content
    assert key(base, Method("spec:bandit:ucb1", None, None)) is None
    entry = arm_key(base, "eagle_lr72", 3, "alpha")["entry"]
    assert len(entry["checkpoint"]["sha256"]) == 64


def multirun(task: list[str], sweeper: str = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"):
    return OmegaConf.create({"hydra": {"sweeper": {"_target_": sweeper, "params": None},
                                       "overrides": {"task": task}}})


def test_count_jobs_of_a_sweep():
    assert count_jobs(multirun(["bandit=ucb1,thompson", "head.rank=d/8,d/16", "seed=0"])) == 4
    assert count_jobs(multirun(["seed=range(3)", "bandit=ucb1,thompson"])) == 6
    n_experiments = len(list((CONF / "experiment").glob("*.yaml")))
    assert count_jobs(multirun(["experiment=glob(*)", "smoke=true"])) == n_experiments
    assert count_jobs(multirun(["seed=0"])) == 1
    assert count_jobs(multirun(["seed=interval(0,1)"])) is None
    assert count_jobs(multirun(["seed=0,1"], sweeper="hydra_plugins.Optuna")) is None


@pytest.mark.slow
def test_design_card_sweep_reuses_only_what_no_swept_setting_touches(design_card_sweep):
    """`-m bandit=ucb1,thompson head.rank=d/8,d/16` run small (tests/conftest.py's
    design_card_sweep, which the notebook tests read too): the first job decodes every method;
    later jobs copy AR and the full-head reference, and decode the policy's method and each arm
    alone themselves (a policy is compared with arms timed beside it, in its job)."""
    sweep = design_card_sweep
    out = (sweep.parent / "run.log").read_text()
    for i in range(1, 5):
        assert f"job {i}/4 (" in out and f"job {i}/4 completed in " in out, out[-3000:]
    jobs = {int(d.name.split("_", 1)[0]): d for d in sweep.iterdir() if (d / ".hydra").is_dir()}
    assert sorted(jobs) == [0, 1, 2, 3]   # ucb1 d/8, ucb1 d/16, thompson d/8, thompson d/16
    recs = {n: [json.loads(line) for line in (d / "records.jsonl").read_text().splitlines()]
            for n, d in jobs.items()}
    by_method = {n: {r["method"]: r for r in rs} for n, rs in recs.items()}
    origin = {n: {m: r.get("reused_from") for m, r in ms.items()} for n, ms in by_method.items()}
    first = str(jobs[0].resolve())
    assert not any(origin[0].values())
    eagle = [m for m in by_method[0] if m.startswith("spec:eagle_lr72@")]
    assert len(eagle) == 4                 # γ 3, 2, 4 and the dyn3d3k2 tree
    shared = ["ar", "ref_full_head:eagle_lr72@3"]
    for n in (1, 2, 3):
        assert set(by_method[n]) == set(by_method[0]) - {"spec:bandit:ucb1/tps"} | {
            "spec:bandit:ucb1/tps" if n < 2 else "spec:bandit:thompson/tps"}
        assert all(origin[n][m] == first for m in shared), origin[n]
        assert not origin[n][f"spec:bandit:{'ucb1' if n < 2 else 'thompson'}/tps"]
    for n in (1, 2, 3):   # each arm alone, prompt lookup included: timed beside the policy
        assert not any(origin[n][m] for m in eagle + ["spec:ngram@3"]), origin[n]
    for n in (1, 2, 3):   # a copy is the record it copies
        for m, o in origin[n].items():
            if o:
                src = by_method[[k for k, d in jobs.items() if str(d.resolve()) == o][0]][m]
                assert by_method[n][m]["tokens"] == src["tokens"]
                assert by_method[n][m]["wall_s"] == src["wall_s"]
        metrics = json.loads((jobs[n] / "job_metrics.json").read_text())
        assert {"regret/final", "rho_tau", "ar/tps", "spec/speedup"} <= set(metrics)
