"""Drafter choice on a real decoding stream: per-step reward and chosen arm against the domain."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

DOMAIN_COLORS = {"code": "#1f77b4", "math": "#2ca02c", "chat": "#d62728"}


def stream(records: Iterable[Mapping[str, Any]], method: str) -> dict[str, list]:
    """Steps of one method in record order: reward, arm index and the prompt's domain per step."""
    out: dict[str, list] = {"reward": [], "arm": [], "domain": []}
    for r in records:
        if r.get("method") != method:
            continue
        out["reward"] += list(r.get("rewards") or [])
        out["arm"] += list(r.get("arms") or [])
        out["domain"] += [r.get("domain")] * len(r.get("arms") or [])
    return out


def plot_stream(records: Iterable[Mapping[str, Any]], names: Sequence[str], path: str | Path | None = None,
                window: int = 25):
    """One column per bandit method: rolling mean reward (top) and the chosen arm (bottom) over
    the steps of the stream, coloured by the prompt's domain. Returns the figure."""
    import matplotlib.pyplot as plt
    import numpy as np

    records = list(records)
    methods = list(dict.fromkeys(r["method"] for r in records if r.get("method", "").startswith("spec:bandit")))
    fig, axes = plt.subplots(2, max(1, len(methods)), figsize=(5.2 * max(1, len(methods)), 5.6),
                             squeeze=False)
    for col, method in enumerate(methods):
        s = stream(records, method)
        steps = np.arange(len(s["arm"]))
        reward = np.asarray(s["reward"], dtype=float)
        kernel = np.ones(window) / window
        smooth = np.convolve(reward, kernel, mode="same") if len(reward) >= window else reward
        top, bottom = axes[0, col], axes[1, col]
        top.plot(steps[:len(smooth)], smooth, color="k", lw=1)
        top.set_title(method.removeprefix("spec:bandit:"), fontsize=10)
        top.set_ylabel(f"reward (rolling {window})")
        top.set_xlabel("rewarded step (steps that proposed drafts)", fontsize=8)
        colors = [DOMAIN_COLORS.get(d, "#7f7f7f") for d in s["domain"]]
        bottom.scatter(steps, s["arm"], c=colors, s=4)
        bottom.set_yticks(range(len(names)), names, fontsize=8)
        bottom.set_xlabel("decoding step (stream order)")
        _shade(bottom, s["domain"])
    handles = [plt.Line2D([], [], marker="o", ls="", color=c, label=d) for d, c in DOMAIN_COLORS.items()]
    fig.legend(handles=handles, loc="upper right", fontsize=8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=90)
    return fig


def _shade(ax: Any, domains: Sequence[str]) -> None:
    """Background bands, one per run of consecutive steps of the same domain."""
    start = 0
    for i in range(1, len(domains) + 1):
        if i == len(domains) or domains[i] != domains[start]:
            ax.axvspan(start, i, color=DOMAIN_COLORS.get(domains[start], "#cccccc"), alpha=0.08, lw=0)
            start = i
