"""Recompute ``head_summary.jsonl`` and ``rho_tps.png`` of head_decode runs from their records,
without decoding again (the heads' isolated latencies are read from the old summary).

    python scripts/head_resummarize.py RUN_DIR [RUN_DIR ...]   # each with records.jsonl + head_summary.jsonl

The committed experiments/results/head_decode*_v2/*/head_summary.jsonl were recomputed this way
(``resummarized_at``); their per-prompt records.jsonl are on branch lab-notebook.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from experiments.head_decode import _figure, rows_from_records
from flashspec.records import read_records


def resummarize(run_dir: Path, commit: str) -> int:
    """Rewrite one run directory's summary; returns the number of rows."""
    old = list(read_records(run_dir / "head_summary.jsonl"))
    records = list(read_records(run_dir / "records.jsonl"))
    latencies = {r["variant"]: r["head_latency_s"] for r in old}
    names = {r["variant"]: r["method"] for r in old}
    rows = rows_from_records(records, latencies, old[0]["gamma"], names)
    with open(run_dir / "head_summary.jsonl", "w") as fh:
        for r in rows:
            fh.write(json.dumps({"experiment": "head_decode", **r, "provenance": old[0]["provenance"],
                                 "resummarized_at": commit}) + "\n")
    _figure(rows, run_dir / "rho_tps.png")
    return len(rows)


def main() -> int:
    commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    for d in sys.argv[1:]:
        print(d, resummarize(Path(d), commit), "rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
