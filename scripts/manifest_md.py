#!/usr/bin/env python
"""Render experiments/results/MANIFEST.md from experiments/results/manifest.yaml.

    python scripts/manifest_md.py           # rewrite MANIFEST.md
    python scripts/manifest_md.py --check   # exit 1 if MANIFEST.md is not the rendering of the YAML

manifest.yaml is the source (tests/test_manifest.py reads it); MANIFEST.md is its readable form.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

RESULTS = Path(__file__).resolve().parents[1] / "experiments" / "results"


def _short(commit: str | None) -> str:
    if not commit:
        return "–"
    if commit == "unknown":
        return "unknown"
    dirty = commit.endswith("-dirty")
    return f"`{commit[:7]}`" + ("-dirty" if dirty else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(manifest: dict[str, Any]) -> str:
    runs = {r["run"]: r for r in manifest["runs"]}
    out = [
        "# experiments/results manifest",
        "",
        "Every number README.md publishes, the run directory under `experiments/results/` whose",
        "records hold it, the commit that produced it and the command. Generated from",
        "`manifest.yaml` by `python scripts/manifest_md.py` (edit the YAML, not this file);",
        "`tests/test_manifest.py` checks that every listed run exists, that nothing under",
        f"`experiments/results/` is unlisted and that the tracked size stays under "
        f"{manifest['max_tracked_bytes'] / 1e6:g} MB.",
        "",
        f"Branch `{manifest['history_branch']}` (= `{manifest['history_commit'][:7]}`, the tree before",
        "the clean-up) keeps what left this directory: logs, `kernel_bench/NOTES.md`, the `not_kept/`",
        "diffs of rejected kernel variants, probe scripts, superseded runs, and the large per-prompt",
        "records whose aggregates are kept here (column *on lab-notebook*).",
        "",
        "Commits: *provenance* is the `provenance.commit` field the records carry (`-dirty`: the run",
        "had uncommitted changes; GPU runs also record `provenance.config.source_commit`, shown as",
        "*source*); *committed in* is the commit that added the records, whose code is what ran.",
        "",
        "## README claims",
        "",
        "| README | claim | run directories |",
        "|---|---|---|",
    ]
    for c in manifest["claims"]:
        dirs = ", ".join(f"`{r}`" for r in c["runs"])
        out.append(f"| {_cell(c['readme'])} | {_cell(c['claim'])} | {dirs} |")
    out += [
        "",
        "## Run directories",
        "",
        "| run directory | provenance | source | committed in | command | on lab-notebook |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        lab = "<br>".join(f"`{Path(p).name}`" for p in r.get("lab_notebook") or []) or ""
        out.append(f"| `{name}` | {_short(r.get('provenance_commit'))} | {_short(r.get('source_commit'))} | "
                   f"{_short(r.get('committed_in'))} | {_cell(r['command'])} | {lab} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare, do not write")
    a = ap.parse_args(argv)
    text = render(yaml.safe_load((RESULTS / "manifest.yaml").read_text()))
    target = RESULTS / "MANIFEST.md"
    if a.check:
        if not target.is_file() or target.read_text() != text:
            print(f"{target} is stale: run python scripts/manifest_md.py", file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
