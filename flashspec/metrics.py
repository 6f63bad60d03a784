"""Metric definitions over decode records (names as in DESIGN.md: α, τ, TPS, speedup)."""
from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from typing import Any, Iterable, Sequence

import numpy as np


def alpha(n_accepted: int, n_proposed: int) -> float | None:
    """Accepted draft tokens / proposed draft tokens (ratio of sums)."""
    return n_accepted / n_proposed if n_proposed else None


def tau(n_accepted: int, steps: int) -> float | None:
    """Tokens emitted per target forward: mean(n_accepted + 1) over steps."""
    return (n_accepted + steps) / steps if steps else None


def alpha_by_depth(hists: Iterable[Sequence[int]]) -> list[float | None]:
    """α at each depth d = 1, 2, ...: of the steps that accepted d - 1 drafts, the share that
    accepted a d-th (from summed acceptance histograms ``hist[n]`` = steps accepting n drafts;
    for a draft tree, the accepted path's depth)."""
    total: list[int] = []
    for h in hists:
        total.extend([0] * (len(h) - len(total)))
        for n, c in enumerate(h):
            total[n] += c
    reach = [sum(total[d:]) for d in range(len(total))]
    return [reach[d] / reach[d - 1] if reach[d - 1] else None for d in range(1, len(total))]


def rates(n_accepted: int, n_proposed: int, steps: int) -> dict[str, float | None]:
    """``{"alpha": α, "tau": τ}`` of one record or group (ratios of sums)."""
    return {"alpha": alpha(n_accepted, n_proposed), "tau": tau(n_accepted, steps)}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize(records: Iterable[dict[str, Any]], baseline: str = "ar") -> list[dict[str, Any]]:
    """One row per (dataset, method): α, τ, TPS (sum tokens / sum batch wall), speedup.

    speedup = median over prompts of TPS(method) / TPS(baseline) on the same prompt and turn.
    """
    recs = [r for r in records if r.get("experiment", "decode") == "decode"]
    base = {(r["dataset"], r["prompt_id"], r["turn"]): r["tps"] for r in recs if r["method"] == baseline}
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in recs:
        groups[(r["dataset"], r["method"])].append(r)
    rows = []
    for (dataset, method), rs in sorted(groups.items()):
        ratios = [r["tps"] / base[k] for r in rs
                  if (k := (r["dataset"], r["prompt_id"], r["turn"])) in base and base[k] > 0]
        steps = sum(r["steps"] for r in rs)
        acc = sum(r["n_accepted"] for r in rs)
        rows.append({"dataset": dataset, "method": method, "prompts": len(rs),
                     "tokens": sum(r["n_new_tokens"] for r in rs),
                     **rates(acc, sum(r["n_proposed"] for r in rs), steps),
                     "tps": pooled_rate(rs),
                     "speedup": statistics.median(ratios) if ratios else None})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Plain-text table of summary rows."""
    cols = ["dataset", "method", "prompts", "tokens", "alpha", "tau", "tps", "speedup"]
    fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
    cells = [cols] + [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def pooled_rate(records: list[dict[str, Any]]) -> float:
    """Σ new tokens / Σ wall seconds of the distinct batches (the records of one batch share
    its wall time; a record without ``batch_id`` is its own batch)."""
    walls = {r.get("batch_id", i): r["wall_s"] for i, r in enumerate(records)}
    return sum(r["n_new_tokens"] for r in records) / max(sum(walls.values()), 1e-9)


def vs_best_interval(records: Iterable[dict[str, Any]], method: str, rivals: Sequence[str],
                     n_boot: int = 2000, seed: int = 0,
                     q: tuple[float, float] = (5.0, 95.0)) -> tuple[float, float] | None:
    """Bootstrap interval of ``pooled_rate(method) / max(pooled_rate(rival))`` over the batches
    of prompts that every one of them decoded: batches resampled with replacement, the best
    rival chosen again in each resample. The best fixed arm in hindsight is a noisy pick too:
    among near-equal arms its rate sits above their common rate by chance (more so at T = 1,
    where each method samples its own continuations), so a point ratio a few per cent under 1
    can be noise. Returns the ``q`` percentiles, or None with fewer than two shared batches."""
    def batches(m: str) -> dict[tuple, tuple[int, float]]:
        groups: dict[Any, list[dict]] = defaultdict(list)
        for i, r in enumerate(method_records(records, m)):
            groups[r.get("batch_id", i)].append(r)
        return {tuple(sorted((str(r.get("prompt_id")), r.get("turn") or 0) for r in g)):
                (sum(r["n_new_tokens"] for r in g), g[0]["wall_s"]) for g in groups.values()}

    records = list(records)
    per = [batches(m) for m in (method, *rivals)]
    shared = sorted(set.intersection(*(set(b) for b in per)))
    if len(shared) < 2 or not rivals:
        return None
    tokens = np.array([[b[k][0] for k in shared] for b in per], dtype=float)   # [methods, batches]
    walls = np.array([[b[k][1] for k in shared] for b in per], dtype=float)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(shared), size=(n_boot, len(shared)))
    weight = np.zeros((n_boot, len(shared)))
    np.add.at(weight, (np.arange(n_boot)[:, None], picks), 1.0)    # times each batch is drawn
    rate = (weight @ tokens.T) / np.maximum(weight @ walls.T, 1e-12)   # [n_boot, methods]
    ratio = rate[:, 0] / rate[:, 1:].max(axis=1)
    lo, hi = np.percentile(ratio, q)
    return float(lo), float(hi)


def steps_per_arm(record: dict[str, Any]) -> dict[int, int]:
    """Steps a policy's record played on each arm index: from its ``arms`` (each step's arm) or
    the packed ``arm_counts`` (scripts/pack_run.py --no-steps); arms it never played absent."""
    if record.get("arm_counts"):
        return {int(a): n for a, n in record["arm_counts"].items() if n}
    return dict(Counter(record.get("arms") or []))


def single_arm(record: dict[str, Any]) -> int | None:
    """The arm index a policy's record played on every step, or None when it played several or
    none."""
    played = steps_per_arm(record)
    return next(iter(played)) if len(played) == 1 else None


def _alone_by_prompt(records: list[dict[str, Any]], alone: dict[int, str]
                     ) -> dict[tuple, dict[str, Any]]:
    """The records of the methods that play an arm alone, by (prompt, turn, method)."""
    methods = set(alone.values())
    return {(r.get("prompt_id"), r.get("turn") or 0, r["method"]): r
            for r in records if r.get("method") in methods}


def step_overhead(records: Iterable[dict[str, Any]], method: str, alone: dict[int, str]
                  ) -> tuple[float, int] | None:
    """What a policy's own work costs a step, apart from which arms it picked: over the prompts
    where ``method`` played one arm on every step, the median of its decode seconds per step
    over those of the method playing that arm alone (``alone``: arm index -> method) on the
    same prompt and turn, and how many prompts that is. Decisions, host facts and drafters kept
    in step show here; which arm was best does not. None without such a prompt."""
    records = list(records)
    ref = _alone_by_prompt(records, alone)
    ratios = []
    for r in method_records(records, method):
        arm = single_arm(r)
        other = ref.get((r.get("prompt_id"), r.get("turn") or 0, alone.get(arm)))
        if other and r["steps"] and other["steps"] and other["decode_s"] > 0:
            ratios.append((r["decode_s"] / r["steps"]) / (other["decode_s"] / other["steps"]))
    return (statistics.median(ratios), len(ratios)) if ratios else None


def priced_rate(records: Iterable[dict[str, Any]], method: str, alone: dict[int, str]
                ) -> float | None:
    """Pooled tok/s ``method`` would have had if each of its steps had cost what a step of the
    same arm cost played alone on the same prompt (its wall time less its decode time, plus its
    steps per arm times that arm's seconds per step alone there): its choices priced without
    its own overhead. Batches of one prompt only (a batch's steps are shared by its rows); None
    when a prompt lacks a reference or its steps per arm are unknown."""
    records = list(records)
    ref = _alone_by_prompt(records, alone)
    tokens = seconds = 0.0
    for r in method_records(records, method):
        counts = steps_per_arm(r)
        if not counts or (r.get("batch_size") or 1) > 1:
            return None
        priced = 0.0
        for arm, n in counts.items():
            other = ref.get((r.get("prompt_id"), r.get("turn") or 0, alone.get(arm)))
            if not other or not other["steps"]:
                return None
            priced += n * other["decode_s"] / other["steps"]
        tokens += r["n_new_tokens"]
        seconds += r["wall_s"] - r["decode_s"] + priced
    return tokens / seconds if seconds > 0 else None


def pooled_tps(records: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Per method over the whole run (every dataset): ``pooled_rate`` of its records."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("experiment", "decode") == "decode":
            groups[r["method"]].append(r)
    return {m: pooled_rate(rs) for m, rs in groups.items()}


def bandit_vs_fixed(records: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The bandit bars on one run's pooled TPS: best bandit / best fixed arm (with its bootstrap
    interval, :func:`vs_best_interval`) and / mean of the fixed arms (fixed = every ``spec:``
    method that is not a bandit), and the headroom any switching policy has on this stream,
    ``oracle_vs_best_fixed``: the fixed arm best on each domain played there (pooled over the
    run) / the best fixed arm. None without both kinds."""
    records = list(records)
    tps = pooled_tps(records)
    bandits = {m: v for m, v in tps.items() if m.startswith("spec:bandit")}
    fixed = {m: v for m, v in tps.items() if m.startswith("spec:") and m not in bandits}
    if not bandits or not fixed:
        return None
    best_b, best_f = max(bandits, key=bandits.get), max(fixed, key=fixed.get)
    mean_f = statistics.fmean(fixed.values())
    oracle, per_domain = domain_oracle(records, list(fixed))
    return {"tps": dict(sorted(tps.items(), key=lambda kv: -kv[1])), "best_bandit": best_b,
            "best_fixed": best_f, "vs_best_fixed": bandits[best_b] / fixed[best_f],
            "vs_best_fixed_interval": vs_best_interval(records, best_b, list(fixed)),
            "vs_mean_fixed": bandits[best_b] / mean_f,
            "oracle_vs_best_fixed": oracle / fixed[best_f], "best_per_domain": per_domain}


def domain_oracle(records: list[dict[str, Any]], methods: list[str]) -> tuple[float, dict[str, str]]:
    """Pooled tok/s of playing, on each domain, the one of ``methods`` fastest there (its own
    tokens and batch walls), and that method per domain: no switching policy that keys on the
    domain can beat it, and only within-domain adaptation can."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r.get("method") in methods and r.get("experiment", "decode") == "decode":
            groups[(r["method"], r.get("domain"))].append(r)
    best: dict[str, str] = {}
    played: list[dict[str, Any]] = []
    for domain in dict.fromkeys(d for _, d in groups):
        m = max((m for m in methods if (m, domain) in groups),
                key=lambda m: pooled_rate(groups[(m, domain)]))
        best[str(domain)] = m
        played += groups[(m, domain)]
    return pooled_rate(played), best


def format_bandit_vs_fixed(cmp: dict[str, Any]) -> str:
    """Pooled TPS per method, then the bandit ratios and the per-domain oracle's."""
    width = max(len(m) for m in cmp["tps"])
    lines = [f"{m.ljust(width)}  {v:8.2f}" for m, v in cmp["tps"].items()]
    lines.append(f"best bandit ({cmp['best_bandit']}) / best fixed ({cmp['best_fixed']}): "
                 f"{cmp['vs_best_fixed']:.3f}; / mean of fixed arms: {cmp['vs_mean_fixed']:.3f}")
    if cmp.get("vs_best_fixed_interval"):
        lo, hi = cmp["vs_best_fixed_interval"]
        lines.append(f"  90 % interval over the prompts (the best fixed arm picked again in each "
                     f"resample): [{lo:.3f}, {hi:.3f}]")
    if len(set(cmp["best_per_domain"].values())) > 1:
        picks = ", ".join(f"{d}: {m}" for d, m in cmp["best_per_domain"].items())
        lines.append(f"per-domain oracle ({picks}) / best fixed: {cmp['oracle_vs_best_fixed']:.3f}")
    else:
        lines.append("per-domain oracle: the best fixed arm is best on every domain (1.000)")
    return "pooled tok/s over the run\n" + "\n".join(lines)


def method_records(records: Iterable[dict[str, Any]], method: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("method") == method]


def mean_step_reward(records: Iterable[dict[str, Any]]) -> float | None:
    """Mean per-step reward over the records' steps (the ``rewards`` lists)."""
    rewards = [x for r in records for x in (r.get("rewards") or [])]
    return statistics.fmean(rewards) if rewards else None


def pseudo_regret(records: Iterable[dict[str, Any]], arm_means: Sequence[float | None]) -> list[float]:
    """Cumulative pseudo-regret Σ_t (μ* − μ_{a_t}) over the records' steps in order, against
    the best fixed arm in hindsight: μ_k is arm k's mean per-step reward when it ran alone on
    the same prompts (None: unmeasured, counted as μ*)."""
    known = [m for m in arm_means if m is not None]
    if not known:
        return []
    best, total, out = max(known), 0.0, []
    for r in records:
        for arm in r.get("arms") or []:
            mu = arm_means[arm] if arm < len(arm_means) else None
            total += best - (best if mu is None else mu)
            out.append(total)
    return out


def arm_method(arm: str) -> str:
    """The decode method of arm ``arm`` (its name) played alone: ``spec:<arm>``."""
    return f"spec:{arm}"


def arm_mean_rewards(records: Sequence[dict[str, Any]], arms: Sequence[str]) -> list[float | None]:
    """μ_k of each arm k (``arms``: names in the policy's index order): the mean per-step reward
    of the job's records of arm k played alone (None: the job did not play it alone)."""
    return [mean_step_reward(method_records(records, arm_method(a))) for a in arms]


def policy_regret(records: Sequence[dict[str, Any]], policy: str, arms: Sequence[str]) -> list[float]:
    """Cumulative pseudo-regret of one job's ``policy`` method (:func:`pseudo_regret`) against
    its arms played alone on the same prompts (:func:`arm_mean_rewards`). The one computation
    behind a decode job's ``regret/final`` and the notebooks' regret curves: both pass the job's
    records and its arm names, so they agree by construction."""
    return pseudo_regret(method_records(records, policy), arm_mean_rewards(records, arms))


def pick_counts(records: Iterable[dict[str, Any]], n_arms: int) -> list[int]:
    """How often each arm was played over the records' steps."""
    counts = [0] * n_arms
    for r in records:
        for arm in r.get("arms") or []:
            counts[arm] += 1
    return counts


def decode_stats(records: list[dict[str, Any]], baseline: list[dict[str, Any]] | None = None
                 ) -> dict[str, float | None]:
    """α, τ, TPS (pooled), decode TPS, step latency p50/p99 and speedup over ``baseline`` (median
    of per-prompt TPS ratios) of one method's records. τ only where the method counts target
    forwards (``steps``): HF baselines do not. For greedy records (T = 0) with tokens,
    ``greedy_equal``: the fraction of prompt turns whose tokens equal the baseline's (1.0: the
    method reproduced target-only AR token for token)."""
    steps = sum(r["steps"] for r in records)
    base_tokens = {(b["prompt_id"], b["turn"]): b["tokens"] for b in baseline or []
                   if b.get("temperature") == 0 and "tokens" in b}
    same = [r["tokens"] == base_tokens[k] for r in records
            if r.get("temperature") == 0 and "tokens" in r
            and (k := (r["prompt_id"], r["turn"])) in base_tokens]
    acc = sum(r["n_accepted"] for r in records)
    base = {(r["prompt_id"], r["turn"]): r["tps"] for r in baseline or []}
    ratios = [r["tps"] / base[k] for r in records
              if (k := (r["prompt_id"], r["turn"])) in base and base[k]]
    decode_s = sum(r["decode_s"] for r in records)
    p50 = [r["step_p50_s"] for r in records if r.get("step_p50_s") is not None]
    p99 = [r["step_p99_s"] for r in records if r.get("step_p99_s") is not None]
    measures_tau = all(r.get("tau") is not None for r in records)
    depth = alpha_by_depth(r.get("accept_hist") or [] for r in records) if measures_tau else []
    return {**rates(acc, sum(r["n_proposed"] for r in records), steps),
            **({} if measures_tau else {"tau": None}),
            "tps": pooled_rate(records) if records else None,
            "decode_tps": sum(r["n_new_tokens"] for r in records) / decode_s if decode_s else None,
            "step_p50_s": statistics.median(p50) if p50 else None,
            "step_p99_s": statistics.median(p99) if p99 else None,
            "speedup": statistics.median(ratios) if ratios else None,
            "greedy_equal": sum(same) / len(same) if same else None,
            **{f"alpha_d{d}": a for d, a in enumerate(depth, start=1)}}
