"""What each policy of a decode job's records cost a step apart from its choices, for records
written before the job metrics carried it (``<method>/step_overhead``), and what its choices
were worth without that cost:

    python scripts/step_overhead.py <job folder> [<job folder> ...]

A job folder holds ``records.jsonl`` (or the packed ``records.jsonl.gz``) and the provenance (in
the records or a ``provenance.json`` beside them); the policy's arms, in index order, are the run
config's drafter set's (:func:`experiments.harness.config_arms`), each played alone as
``spec:<arm label>``. Prints one JSON object per folder: ``step_overhead``, method -> [median
seconds per step over the arm's alone, prompts] (:func:`flashspec.metrics.step_overhead`);
``priced_vs_best_fixed``, method -> its pooled tok/s with every step priced at its arm's seconds
per step alone on that prompt (:func:`flashspec.metrics.priced_rate`) over the best arm alone's
pooled tok/s.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments.harness import config_arms  # noqa: E402
from flashspec.metrics import arm_method, pooled_tps, priced_rate, step_overhead  # noqa: E402
from flashspec.records import read_records  # noqa: E402


def overheads(job: Path) -> dict[str, dict]:
    path = next((p for p in (job / "records.jsonl", job / "records.jsonl.gz") if p.exists()), None)
    if path is None:
        raise SystemExit(f"step_overhead: no records.jsonl(.gz) in {job}")
    records = list(read_records(path))
    prov = records[0].get("provenance") or json.loads((job / "provenance.json").read_text())
    alone = {i: arm_method(a.label) for i, a in enumerate(config_arms(prov["config"]["drafters"]))}
    policies = sorted({r["method"] for r in records if r["method"].startswith("spec:bandit")})
    tps = pooled_tps(records)
    best = max((tps[m] for m in alone.values() if m in tps), default=None)
    out: dict[str, dict] = {"step_overhead": {}, "priced_vs_best_fixed": {}}
    for method in policies:
        cost = step_overhead(records, method, alone)
        if cost is not None:
            out["step_overhead"][method] = [round(cost[0], 4), cost[1]]
        priced = priced_rate(records, method, alone)
        if priced is not None and best:
            out["priced_vs_best_fixed"][method] = round(priced / best, 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jobs", nargs="+", type=Path)
    for job in ap.parse_args().jobs:
        print(json.dumps({"job": str(job), **overheads(job)}, indent=1))


if __name__ == "__main__":
    main()
