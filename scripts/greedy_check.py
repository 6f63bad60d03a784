#!/usr/bin/env python
"""Compare every method's greedy tokens with target-only AR in decode records (same prompts),
or with the same method's tokens in another run's records (``--against``: another hardware
profile or runtime on the same prompts must give the same tokens).

    python scripts/greedy_check.py RUN_DIR/records.jsonl [--baseline ar]
    python scripts/greedy_check.py RUN_DIR/records.jsonl --against OTHER_RUN/records.jsonl

Prints one line per method: rows equal / compared and the first differing position of each
mismatch (bf16 ties show up here; fp32 must match everywhere). Exit 1 if any ours (every
method but the HF baselines) differ.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("records")
    ap.add_argument("--baseline", default="ar")
    ap.add_argument("--against", help="another run's records: compare each method with itself there")
    a = ap.parse_args()
    rows = [json.loads(line) for line in open(a.records)]
    if a.against:
        other = [json.loads(line) for line in open(a.against)]
        base = {(r["method"], r["prompt_id"], r["turn"]): r["tokens"] for r in other}
    else:
        base = {(r["prompt_id"], r["turn"]): r["tokens"] for r in rows if r["method"] == a.baseline}
    stats: dict[str, list] = defaultdict(lambda: [0, 0, []])
    for r in rows:
        key = (r["method"], r["prompt_id"], r["turn"]) if a.against else (r["prompt_id"], r["turn"])
        if (not a.against and r["method"] == a.baseline) or key not in base or r["turn"] > 0:
            continue  # turn 2 follows each method's own turn-1 answer: compare turn 1 only
        s = stats[r["method"]]
        s[1] += 1
        if r["tokens"] == base[key]:
            s[0] += 1
        else:
            s[2].append(first_diff(r["tokens"], base[key]))
    bad = False
    for method, (eq, n, diffs) in sorted(stats.items()):
        print(json.dumps({"method": method, "equal": eq, "compared": n, "first_diff_at": diffs}))
        bad |= not method.startswith("hf_") and eq != n
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
