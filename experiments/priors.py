"""The decode job's side of the priors store (:mod:`flashspec.bandits.priors`): the key of a
run, the warm start of its policies before the first step, and what it writes at the end.

``priors.use`` (conf/config.yaml) starts every learning policy of the job that takes priors
from the store under ``priors.path`` (the committed one: assets/priors) when the store holds
this run's key; anything else is a logged cold start. At the end every job writes what it
measured of each arm, one file per prompt domain, to ``<output_dir>/priors/`` and, with
``priors.save=<dir>`` (``priors.save=assets/priors`` updates the committed default), there too.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf

from flashspec.bandits import Policy
from flashspec.bandits.priors import (ArmStats, PriorKey, Priors, arm_stats, describe_miss,
                                      load_priors, pooled, save_priors)
from flashspec.data import Prompt
from flashspec.metrics import method_records
from flashspec.paths import repo_path
from flashspec.records import config_hash, git_commit

log = logging.getLogger(__name__)
DIR = "priors"   # under the run directory


def prior_key(cfg: DictConfig, arm_labels: Sequence[str], domain: str, reward: str) -> PriorKey:
    """This run's key for one prompt domain: target (source, dtype, quantization), hardware
    profile, sampling, the arm labels and a digest of the drafters' resolved entries with their
    checkpoint files by content (the same digest the sweep's record reuse keys arms by)."""
    from experiments.decode import _with_file_hashes   # decode imports this module
    t, exp = cfg.target, cfg.experiment
    drafters = OmegaConf.to_container(cfg.drafters, resolve=True)
    sampling = "greedy" if float(exp.temperature) == 0 else \
        f"T{float(exp.temperature):g},k{int(exp.top_k)},p{float(exp.top_p):g}"
    batch = int(exp.get("batch_size") or 1)
    if batch > 1:   # a step's cost, and so an arm's rate, depends on the rows it verifies
        sampling += f",B{batch}"
    return PriorKey(target=f"{t.source}/{t.dtype}/{t.get('quantization') or 'none'}",
                    hardware=str(cfg.hardware.name), domain=str(domain), reward=reward,
                    arms=tuple(arm_labels), sampling=sampling,
                    drafters=config_hash(_with_file_hashes(drafters), ignore=()))


def warm_start(cfg: DictConfig, policies: Sequence[Policy], arm_labels: Sequence[str],
               prompts: Sequence[Prompt]) -> dict[str, str]:
    """Starts each learning policy from the stored priors of this run's key where there are
    some; returns policy label -> the file it started from (for the records' provenance)."""
    conf = cfg.get("priors") or {}
    learning = [p for p in policies if p.learns]
    if not learning or not arm_labels:
        return {}
    if not conf.get("use", False):
        log.info("priors.use=false: %s start cold", ", ".join(p.label for p in learning))
        return {}
    domains = sorted({p.domain for p in prompts})
    used: dict[str, str] = {}
    for policy in learning:
        if not policy.takes_priors:
            log.info("priors: bandit=%s does not start from priors; it starts cold", policy.label)
            continue
        if policy.cold:
            log.info("priors: bandit=%s is set cold (cold: true); it starts cold", policy.label)
            continue
        # a stream of several domains: a policy keyed on the domain starts each domain's
        # contexts from that domain's file; one that is not starts from all of them pooled
        # (the stream's mixture), and only where every domain has one
        per_domain = len(domains) != 1 and "domain" in policy.context_keys
        mixed = len(domains) != 1 and not per_domain
        paths, parts = [], []
        for domain in domains:
            where = f" on {domain}" if per_domain else ""
            key = prior_key(cfg, arm_labels, domain, policy.reward_kind)
            priors = load_priors(repo_path(conf.path), key)
            if priors is None:
                log.info("priors: %s; %s starts cold%s", describe_miss(repo_path(conf.path), key),
                         policy.label, where)
                if mixed:
                    break
                continue
            pulls, means, costs = priors.aligned(arm_labels)
            paths.append(str(repo_path(conf.path) / key.filename))
            if mixed:
                parts.append((pulls, means, costs))
                continue
            if per_domain:
                policy.warm_start_domain(domain, pulls, means, costs, weight=float(conf.weight))
            else:
                policy.warm_start(pulls, means, costs, weight=float(conf.weight))
            _said(policy, where, paths[-1], float(conf.weight), arm_labels, means, pulls)
        if mixed:
            if len(parts) != len(domains):
                paths = []
            else:
                pulls, means, costs = pooled(parts, policy.reward_kind)
                policy.warm_start(pulls, means, costs, weight=float(conf.weight))
                _said(policy, f" on {'+'.join(domains)} pooled (it does not tell them apart)",
                      ", ".join(paths), float(conf.weight), arm_labels, means, pulls)
        if paths:
            used[policy.label] = ", ".join(paths)
    return used


def _said(policy: Policy, where: str, path: str, weight: float, arm_labels: Sequence[str],
          means: Sequence[float], pulls: Sequence[float]) -> None:
    log.info("priors: %s starts%s from %s (per arm, up to %g steps each: %s)", policy.label,
             where, path, weight,
             ", ".join(f"{a} {m:.3g} x{int(n)}" for a, m, n in zip(arm_labels, means, pulls)))


def measured(records: list[dict[str, Any]], arm_labels: Sequence[str], arm_methods: dict[int, str],
             spec: str | None, reward: str = "alpha") -> dict[str, dict[str, Any]]:
    """Per prompt domain, each arm's stats: from the arm's records played alone
    (``arm_methods``: arm index -> method; the unbiased estimate) where the job ran it, else
    from the steps the policy's method (``spec``) played it.

    The mean is the mean per-step reward, except for ``reward="tps"`` on an arm played alone:
    then it is the arm's pooled rate, decoded tokens / decode seconds, which is what a rate
    policy (:class:`~flashspec.bandits.rate.RateStats`) estimates. The mean of per-step tok/s
    is biased upward, most for the arms whose steps vary most (prompt lookup: cheap steps that
    now and then accept a whole draft), and would rank the arms wrongly."""
    domains = sorted({r["domain"] for r in records if r.get("domain") is not None})
    out: dict[str, dict[str, Any]] = {}
    for d in domains:
        stats = {}
        for i, label in enumerate(arm_labels):
            if i in arm_methods:
                recs = [r for r in method_records(records, arm_methods[i]) if r["domain"] == d]
                steps = sum(r["steps"] for r in recs)
                seconds = sum(r["decode_s"] for r in recs)
                cost = seconds / steps if steps else None
                rewards = [x for r in recs for x in r.get("rewards") or []]
                if reward == "tps" and steps and seconds > 0:   # the rate needs no per-step list
                    stats[label] = ArmStats(len(rewards) or steps,
                                            sum(r["n_new_tokens"] for r in recs) / seconds, cost)
                    continue
            else:   # only where every step has its reward: arms and rewards then align
                recs = [r for r in method_records(records, spec or "") if r["domain"] == d
                        and len(r.get("arms") or []) == len(r.get("rewards") or [])]
                rewards = [x for r in recs for a, x in zip(r["arms"], r["rewards"]) if a == i]
                cost = None
            stats[label] = arm_stats(rewards, cost)
        out[d] = stats
    return out


def save(cfg: DictConfig, records: list[dict[str, Any]], arm_labels: Sequence[str],
         arm_methods: dict[int, str], spec: str | None, reward: str, run_path) -> list[str]:
    """Writes what this job measured of each arm, one file per domain, to the run directory's
    ``priors/`` and to ``priors.save`` when set (not for ``smoke=true``); returns the paths
    written."""
    if not arm_labels or not (arm_methods or spec):
        return []
    conf = cfg.get("priors") or {}
    save_to = conf.get("save") if not cfg.get("smoke") else None   # a smoke run's few steps
    dirs = [run_path / DIR] + ([repo_path(save_to)] if save_to else [])   # stay in its dir
    written = []
    for domain, stats in measured(records, arm_labels, arm_methods, spec, reward).items():
        if not any(s.pulls for s in stats.values()):
            continue
        data = cfg.get("dataset") or {}
        priors = Priors(prior_key(cfg, arm_labels, domain, reward), stats,
                        {"run": str(run_path), "commit": git_commit(),
                         # a prior measured on the prompts it is then evaluated on is in-sample:
                         # the split says whether a warm start saw the eval prompts
                         "data": {k: data.get(k) for k in ("name", "split", "n_prompts", "seed")},
                         "from": "each arm alone where the job ran it" + (
                             f", else the steps of {spec} on it" if spec else "")})
        written += [str(save_priors(d, priors)) for d in dirs]
    if written:
        log.info("priors written: %s", ", ".join(written))
    return written
