"""Bandit simulation: cumulative regret vs T of each selection policy on synthetic arms.

Records (JSONL, one per scenario x policy, plus the comparison with the seed paper) and the
regret figure go to ``cfg.output_dir``; summaries go to W&B through ``cfg.logger``.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from experiments.harness import build, run_dir
from flashspec.bandits.sim import (ChainScenario, Scenario, SimResult, draw_chains, draw_rewards,
                                   env_seeds, make_chain_scenario, make_scenario, simulate,
                                   simulate_chains)
from flashspec.errors import FlashSpecError
from flashspec.records import NullLogger
from flashspec.theory import lai_robbins_bound, ucb1_regret_bound

SEED_RULE = "SeedSequence([seed, crc32(scenario), replicate, stream]); stream 0 = rewards, 1 = policy"


def run(cfg: DictConfig) -> dict[str, Any]:
    """Simulate every (scenario, policy) pair; return the final regrets."""
    exp = cfg.experiment
    size = _size(exp, bool(cfg.smoke))
    policies = OmegaConf.to_container(exp.policies, resolve=True)
    jobs = _jobs(exp, policies, size, int(cfg.seed))
    results: dict[str, dict[str, float]] = {}
    with run_dir(cfg, exp.records) as run:
        done = run.done_keys("kind", "scenario", "policy")
        bar = tqdm(jobs, desc="bandit_sim", disable=not exp.progress)
        for scn, rewards, label in bar:
            bar.set_postfix_str(f"{scn.name}/{label}")
            if ("regret", scn.name, label) in done:
                continue
            rec = _run_one(scn, rewards, label, policies[label], size, int(cfg.seed), bool(exp.progress))
            run.write(rec)
            results.setdefault(scn.name, {})[label] = rec["final_regret_mean"]
            run.logger.summary({f"{scn.name}/{label}/final_regret": rec["final_regret_mean"]})
        records = list(_read(run.writer.path))
        _log_tables(run.logger, records)
        comparison = _paper_comparison(exp, records)
        if comparison is not None and ("paper_comparison", comparison["scenario"], None) not in done:
            run.write(comparison)
            run.logger.summary({f"paper/{k}": v for k, v in comparison["ours"].items()})
        _figure(records, run.path / exp.figure)
    return {"records": str(run.writer.path), "figure": str(run.path / exp.figure),
            "final_regret": results, "paper_comparison": comparison}


def _size(exp: DictConfig, smoke: bool) -> dict[str, int]:
    size = {k: int(exp[k]) for k in ("horizon", "n_seeds", "n_points")}
    if smoke:
        size.update({k: int(v) for k, v in exp.smoke.items()})
    if size["horizon"] < 1 or size["n_seeds"] < 2 or size["n_points"] < 2:
        raise FlashSpecError(f"bandit_sim needs horizon >= 1, n_seeds >= 2, n_points >= 2; got {size}")
    return size


def _jobs(exp: DictConfig, policies: dict, size: dict[str, int],
          seed: int) -> list[tuple[Scenario | ChainScenario, np.ndarray, str]]:
    """(scenario, rewards [seeds, T, K] or a chain scenario's accepted runs [seeds, T,
    drafters], policy label) for every pair to simulate."""
    jobs = []
    horizon, n_seeds = size["horizon"], size["n_seeds"]
    for name, spec in OmegaConf.to_container(exp.scenarios, resolve=True).items():
        if "chains" in spec:   # arms (drafter, γ) sharing each drafter's per-depth acceptance
            c = spec["chains"]
            scn = make_chain_scenario(name, horizon, c["alphas"], c["arms"], c.get("costs"),
                                      c.get("reward", "tps"))
            scn.spec["title"] = spec.get("title", name)
            rewards = draw_chains(scn, env_seeds(seed, name, n_seeds, 0))
            labels = spec.get("policies") or list(exp.default_policies)
            _check_labels(name, labels, policies)
            jobs += [(scn, rewards, label) for label in labels]
            continue
        changes = [round(f * horizon) for f in spec.get("change_fractions") or ()]
        scn = make_scenario(name, horizon, spec["means"], spec.get("rewards", "bernoulli"),
                            spec.get("concentration", 10.0), changes, spec.get("domain_probs"), seed)
        scn.spec["title"] = spec.get("title", name)
        rewards = draw_rewards(scn, env_seeds(seed, name, n_seeds, 0))
        labels = spec.get("policies") or list(exp.default_policies)
        _check_labels(name, labels, policies)
        jobs += [(scn, rewards, label) for label in labels]
    return jobs


def _check_labels(name: str, labels: list[str], policies: dict) -> None:
    missing = [p for p in labels if p not in policies]
    if missing:
        raise FlashSpecError(f"scenario {name} lists policies {missing} absent from "
                             f"experiment.policies ({', '.join(policies)})")


def _run_one(scn: Scenario | ChainScenario, rewards: np.ndarray, label: str, pcfg: dict, size: dict[str, int],
             seed: int, progress: bool) -> dict[str, Any]:
    # what the scenario knows and the policy config asks for (the oracle's means, EXP3's horizon)
    overrides = {k: v for k, v in {"means": scn.means, "horizon": scn.horizon}.items() if k in pcfg}
    if isinstance(scn, ChainScenario):   # every policy learns the scenario's reward, in range
        overrides.update(reward=scn.reward, reward_scale=scn.reward_range)
    seeds = env_seeds(seed, scn.name, rewards.shape[0], 1)
    policy = build(pcfg)(scn.n_arms, seeds, **overrides)
    start = time.perf_counter()
    if isinstance(scn, ChainScenario):
        res = simulate_chains(policy, scn, rewards)
    else:
        res = simulate(policy, scn, rewards, policy.full_info, progress, desc=f"{scn.name}/{label}")
    wall = time.perf_counter() - start
    return _record(scn, label, pcfg, res, size["n_points"], wall)


def _record(scn: Scenario | ChainScenario, label: str, pcfg: dict, res: SimResult, n_points: int, wall: float) -> dict:
    horizon = scn.horizon
    ts = np.unique(np.linspace(1, horizon, n_points).round().astype(int))
    curve = res.regret[:, ts - 1]
    final = res.regret[:, -1]
    best = scn.gaps[np.arange(horizon)[None, :], res.arms] == 0
    pulls = np.stack([(res.arms == k).mean(axis=1) for k in range(scn.n_arms)], axis=1)
    rec: dict[str, Any] = {
        "kind": "regret", "experiment": "bandit_sim", "scenario": scn.name, "title": scn.spec["title"],
        "policy": label, "policy_config": pcfg, "scenario_spec": scn.spec, "horizon": horizon,
        "n_arms": scn.n_arms, "n_seeds": len(final), "seed_rule": SEED_RULE,
        "final_regret_mean": _r(final.mean()), "final_regret_std": _r(final.std(ddof=1)),
        "final_regret_per_seed": [_r(x) for x in final],
        "best_arm_rate": _r(best.mean()), "pull_fraction": [_r(x) for x in pulls.mean(axis=0)],
        "curve": {"t": ts.tolist(), "mean": [_r(x) for x in curve.mean(axis=0)],
                  "std": [_r(x) for x in curve.std(axis=0, ddof=1)]},
        "wall_s": round(wall, 3),
    }
    cps = scn.spec["change_points"]
    if cps:  # regret accrued inside each stationary segment (adaptation after each change)
        edges = [0, *cps, horizon]
        ends = res.regret[:, [e - 1 for e in edges[1:]]]
        seg = np.diff(np.concatenate([np.zeros((len(final), 1)), ends], axis=1), axis=1)
        rec["segment_regret_mean"] = [_r(x) for x in seg.mean(axis=0)]
    rec.update(_bounds(scn, ts))
    if rec.get("ucb1_bound") is not None:
        rec["below_ucb1_bound"] = bool(rec["final_regret_mean"] < rec["ucb1_bound"])
    return rec


def _bounds(scn: Scenario | ChainScenario, ts: np.ndarray) -> dict[str, Any]:
    """UCB1 upper bound (and the Bernoulli Lai-Robbins lower bound) for stationary scenarios."""
    if isinstance(scn, ChainScenario):
        return {"ucb1_bound": None, "bound_note": "no UCB1 bound: chain arms share outcomes and "
                                                  "tokens per second is not a rate in [0, 1]"}
    stationary = scn.domains is None and not scn.spec["change_points"]
    if not stationary:
        return {"ucb1_bound": None, "bound_note": "no UCB1 bound: the means are not stationary"}
    means = scn.means[0].tolist()
    out = {"ucb1_bound": _r(ucb1_regret_bound(means, scn.horizon)),
           "ucb1_bound_curve": {"t": ts.tolist(), "value": [_r(ucb1_regret_bound(means, t)) for t in ts]},
           "bound_note": "Auer et al. 2002 Thm 1: sum 8 ln T / gap + (1 + pi^2/3) sum gap"}
    if scn.rewards == "bernoulli":
        out["lai_robbins_bound"] = _r(lai_robbins_bound(means, scn.horizon))
    return out


def _paper_comparison(exp: DictConfig, records: list[dict]) -> dict[str, Any] | None:
    """Our UCB1 / Thompson regret next to the seed paper's numbers, in the paper's setting."""
    paper = exp.get("paper")
    if paper is None:
        return None
    runs = {r["policy"]: r for r in records if r.get("kind") == "regret" and r["scenario"] == paper.scenario}
    if not {"ucb1", "thompson"} <= set(runs):
        return None
    ucb, ts = runs["ucb1"], runs["thompson"]
    bound = ucb["ucb1_bound"]
    return {
        "kind": "paper_comparison", "experiment": "bandit_sim", "scenario": paper.scenario, "policy": None,
        "arm_means": ucb["scenario_spec"]["means"], "horizon": ucb["horizon"], "n_seeds": ucb["n_seeds"],
        "ours": {"ucb1": ucb["final_regret_mean"], "ucb1_std": ucb["final_regret_std"],
                 "thompson": ts["final_regret_mean"], "thompson_std": ts["final_regret_std"],
                 "ucb1_bound": bound},
        "paper": {"ucb1": float(paper.ucb1), "thompson": float(paper.thompson), "bound": float(paper.bound)},
        "bar_met": bool(ts["final_regret_mean"] < ucb["final_regret_mean"] < bound),
    }


def _log_tables(logger: NullLogger, records: list[dict]) -> None:
    runs = [r for r in records if r.get("kind") == "regret"]
    logger.table("final_regret", [{k: r[k] for k in ("scenario", "policy", "final_regret_mean",
                                                         "final_regret_std", "best_arm_rate", "n_seeds")}
                                  | {"ucb1_bound": r.get("ucb1_bound")} for r in runs])
    logger.table("regret_curves", [{"scenario": r["scenario"], "policy": r["policy"], "t": t, "mean": m, "std": s}
                                   for r in runs for t, m, s in zip(r["curve"]["t"], r["curve"]["mean"],
                                                                    r["curve"]["std"])])


def _figure(records: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flashspec.analysis.bandit_plot import plot_regret
    plt.close(plot_regret(records, path))


def _read(path: Path) -> list[dict]:
    from flashspec.records import read_records
    return list(read_records(path))


def _r(x: float) -> float:
    """Round for compact records (4 significant digits past the point are plenty)."""
    return round(float(x), 4)
