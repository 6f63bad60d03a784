"""Packs one decode job folder for committing under experiments/results/.

    python scripts/pack_run.py <job folder> experiments/results/<run>[/<sub>]

Writes, into the destination:
  records.jsonl.gz   the records without ``text`` and ``rewards`` (size), their ``tokens`` as
                     ``tokens_sha256`` (sha256 of the canonical JSON of the token list: outputs
                     stay comparable across methods and runs), ``provenance`` moved out; with
                     ``--no-steps`` also each step's arm (``arms``) as ``arm_counts``, steps per
                     arm index (a bench job's records shrink about tenfold);
  provenance.json    the first record's provenance (the job's, once);
  job_metrics.json   as the runner wrote it;
  summary.txt        the tables the runner printed (run.log from its first table on, without
                     the log prefixes);
  stream.png         when the job drew one.
Then add the run to experiments/results/manifest.yaml and regenerate the results page.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashspec.records import canonical_json, read_records  # noqa: E402

DROP = ("text", "rewards", "provenance")
PREFIX = re.compile(r"^\[[^\]]*\]\[[^\]]*\]\[[A-Z]+\] - ")


def pack(job: Path, dest: Path, steps: bool = True) -> Path:
    records = list(read_records(job / "records.jsonl"))
    if not records:
        raise SystemExit(f"pack_run: no records in {job / 'records.jsonl'}")
    dest.mkdir(parents=True, exist_ok=True)
    provenance = records[0].get("provenance")
    with gzip.open(dest / "records.jsonl.gz", "wt") as out:
        for rec in records:
            slim = {k: v for k, v in rec.items() if k not in DROP and k != "tokens"}
            if not steps and "arms" in slim:
                arms = slim.pop("arms")
                slim["arm_counts"] = {str(a): arms.count(a) for a in sorted(set(arms))}
            if "tokens" in rec:
                slim["tokens_sha256"] = hashlib.sha256(
                    canonical_json(rec["tokens"]).encode()).hexdigest()
            out.write(json.dumps(slim) + "\n")
    if provenance is not None:
        (dest / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")
    for name in ("job_metrics.json", "stream.png"):
        if (job / name).exists():
            shutil.copyfile(job / name, dest / name)
    lines = (job / "run.log").read_text().splitlines() if (job / "run.log").exists() else []
    first = next((i for i, line in enumerate(lines) if line.startswith("dataset ")), None)
    if first is not None:
        (dest / "summary.txt").write_text(
            "\n".join(PREFIX.sub("", line) for line in lines[first:]) + "\n")
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job", type=Path, help="a decode job folder (records.jsonl, run.log, ...)")
    ap.add_argument("dest", type=Path, help="experiments/results/<run>[/<sub>]")
    ap.add_argument("--no-steps", action="store_true",
                    help="store steps per arm instead of each step's arm")
    args = ap.parse_args()
    print(pack(args.job, args.dest, steps=not args.no_steps))


if __name__ == "__main__":
    main()
