"""Predicted against measured ρ_TPS (SlimSpec's cost model checked on real decoding)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

MARKERS = {"humaneval": "o", "gsm8k": "s", "mtbench": "^", "mixed": "D"}


def plot_rho_tps(rows: Iterable[Mapping[str, Any]], path: str | Path | None = None):
    """Scatter of predicted vs measured ρ_TPS per (dataset, head variant), the y = x line and a
    ±5 % band. Rows come from experiment=head_decode (``head_summary.jsonl``); where they hold
    ``rho_tps_pred_loop`` (ν, κ timed in the decode loop) it is drawn filled, the prediction
    from heads timed alone hollow."""
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("variant") != "full"]
    fig, ax = plt.subplots(figsize=(5.4, 4.8))
    values = [v for r in rows for v in (r["rho_tps_pred"], r["rho_tps_meas"], r.get("rho_tps_pred_loop"))
              if v is not None] or [1.0]
    lo, hi = min(values + [1.0]) * 0.95, max(values + [1.0]) * 1.05
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.95, hi * 0.95], [lo * 1.05, hi * 1.05], color="k", alpha=0.07,
                    label="±5 %")
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    cmap = plt.get_cmap("tab10")
    looped = any(r.get("rho_tps_pred_loop") is not None for r in rows)
    for r in rows:
        color, marker = cmap(variants.index(r["variant"]) % 10), MARKERS.get(r["dataset"], "x")
        ax.scatter(r["rho_tps_pred"], r["rho_tps_meas"], marker=marker, s=40,
                   **({"facecolors": "none", "edgecolors": color} if looped else {"color": color}))
        if r.get("rho_tps_pred_loop") is not None:
            ax.scatter(r["rho_tps_pred_loop"], r["rho_tps_meas"], marker=marker, color=color, s=40)
    if looped:
        ax.scatter([], [], marker="o", facecolors="none", edgecolors="gray", label="ν, κ from heads timed alone")
        ax.scatter([], [], marker="o", color="gray", label="ν, κ timed in the decode loop")
    for i, v in enumerate(variants):
        ax.scatter([], [], color=cmap(i % 10), label=v)
    for d, m in MARKERS.items():
        if any(r["dataset"] == d for r in rows):
            ax.scatter([], [], marker=m, color="gray", label=d)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted ρ_TPS = ρ_τ(1+κ)/(1+νκ)")
    decode = any("rho_tps_meas_wall" in r for r in rows)      # newer rows: decode throughput
    ax.set_ylabel("measured ρ_TPS = " + ("decode " if decode else "") + "TPS(variant)/TPS(full)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=90)
    return fig
