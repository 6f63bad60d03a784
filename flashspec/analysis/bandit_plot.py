"""Regret-vs-T figure from bandit_sim records (used by the experiment and the notebook)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

# One colour per policy, stable across panels.
COLORS = {"fixed": "#7f7f7f", "eps_greedy": "#bcbd22", "ucb1": "#1f77b4", "thompson": "#d62728",
          "sw_ucb": "#17becf", "d_thompson": "#ff7f0e", "exp3": "#9467bd", "oracle": "#2ca02c",
          "contextual": "#e377c2"}


def plot_regret(records: Iterable[dict[str, Any]], path: str | Path | None = None):
    """One panel per scenario: mean cumulative regret ± std over seeds per policy, and the UCB1
    bound (dashed) where the scenario is stationary. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    runs = [r for r in records if r.get("kind") == "regret"]
    scenarios = list(dict.fromkeys(r["scenario"] for r in runs))
    cols = min(2, len(scenarios)) or 1
    rows = math.ceil(len(scenarios) / cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 4.4 * rows), squeeze=False)
    for ax, scn in zip(axes.flat, scenarios):
        _panel(ax, scn, [r for r in runs if r["scenario"] == scn])
    for ax in list(axes.flat)[len(scenarios):]:
        ax.set_visible(False)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=90)
    return fig


def _panel(ax: Any, scenario: str, runs: list[dict[str, Any]]) -> None:
    tops = []
    for r in runs:
        c = r["curve"]
        mean, std = c["mean"], c["std"]
        color = COLORS.get(r["policy"])
        label = f"{r['policy']}  {r['final_regret_mean']:.1f} ± {r['final_regret_std']:.1f}"
        ax.plot(c["t"], mean, color=color, label=label, lw=1.6)
        ax.fill_between(c["t"], [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                        color=color, alpha=0.18, lw=0)
        if r["policy"] != "fixed":
            tops.append(r["final_regret_mean"] + r["final_regret_std"])
    first = runs[0]
    top = max(tops) if tops else 1.0
    bound = first.get("ucb1_bound_curve")
    if bound:
        shown = first["ucb1_bound"] <= 2.0 * top  # keep the policies readable under a far bound
        ax.plot(bound["t"], bound["value"], "k--", lw=1.2,
                label=f"UCB1 bound  {first['ucb1_bound']:.1f}" + ("" if shown else " (above the axis)"))
        top = max(top, first["ucb1_bound"]) if shown else top
    for cp in first["scenario_spec"].get("change_points") or ():
        ax.axvline(cp, color="k", ls=":", lw=0.8)
    ax.set_ylim(0, 1.1 * top)
    ax.set_xlim(0, first["horizon"])
    ax.set_title(f"{scenario}: {first['title']}", fontsize=9)
    ax.set_xlabel("T (steps)")
    ax.set_ylabel("cumulative regret")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
