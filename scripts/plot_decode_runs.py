#!/usr/bin/env python
"""Side-by-side decode runs as one figure: TPS per method (median over prompts) per run.

    python scripts/plot_decode_runs.py RUN_DIR [RUN_DIR ...] -o tps.png

Each RUN_DIR holds a decode ``records.jsonl`` or ``records.jsonl.gz`` (e.g.
experiments/results/bench_h100_s9473/hf_he); bars are grouped by run (labelled
``<dataset> B=<batch>``), one colour per method, log scale (HF eager and our graphed engine
differ by more than 10x).
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from flashspec.records import read_records  # noqa: E402


def run_tps(run: Path) -> tuple[str, dict[str, float]]:
    """(label, {method: median TPS over prompts}) of one run directory."""
    plain = run / "records.jsonl"   # or gzipped, as committed runs keep it
    rows = list(read_records(plain if plain.exists() else run / "records.jsonl.gz"))
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r["method"], []).append(r["tps"])
    label = f"{rows[0]['dataset']} B={rows[0]['batch_size']}\n({run.name})"
    return label, {m: statistics.median(v) for m, v in sorted(by.items())}


def plot(runs: list[Path], out: Path) -> Path:
    data = [run_tps(r) for r in runs]
    methods = sorted({m for _, d in data for m in d})
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(2.2 + 1.8 * len(runs), 4.2))
    for i, m in enumerate(methods):
        xs = [j + i * width for j, (_, d) in enumerate(data) if m in d]
        ax.bar(xs, [d[m] for _, d in data if m in d], width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(data))], [lab for lab, _ in data], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s per prompt (median; prefill included)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("-o", "--out", type=Path, required=True)
    a = ap.parse_args()
    print(plot(a.runs, a.out))


if __name__ == "__main__":
    main()
