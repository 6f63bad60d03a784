#!/usr/bin/env python
"""Render RESULTS.md and README.md's headline table from experiments/results/manifest.yaml.

    python scripts/results_page.py           # rewrite RESULTS.md and README's headline block
    python scripts/results_page.py --check   # exit 1 if either is not the rendering of the manifest

A number is published by committing its records and a manifest entry, never by typing it here or
in the Markdown: the headline table and every claim value are read from the committed records by
a declarative selector (see `measure`), so a record that changes makes the page stale, and
tests/test_manifest.py fails until the page is regenerated.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
REL = "experiments/results"
PAGE = ROOT / "RESULTS.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- headline:begin -->", "<!-- headline:end -->"


class SelectorError(ValueError):
    """A selector that matches nothing, or more than its aggregation allows."""


def _load(path: Path) -> list[dict[str, Any]]:
    """The records of one file: a .json object is one record, a .jsonl line one record (.gz read too)."""
    raw = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
    name = path.name[:-3] if path.suffix == ".gz" else path.name
    if name.endswith(".json"):
        return [json.loads(raw)]
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def _files(spec: dict[str, Any]) -> list[Path]:
    run = RESULTS / spec["run"]
    files = sorted(p for p in run.glob(spec["file"]) if p.is_file())
    if not files:
        raise SelectorError(f"no file {spec['file']!r} under {REL}/{spec['run']}")
    return files


def _match(rec: dict[str, Any], where: dict[str, Any]) -> bool:
    return all(k in rec and rec[k] == v for k, v in where.items())


def _one(records: list[dict[str, Any]], where: dict[str, Any], path: Path) -> dict[str, Any]:
    hits = [r for r in records if _match(r, where)]
    if len(hits) != 1:
        raise SelectorError(f"{path.relative_to(ROOT)}: {len(hits)} records match {where} (want 1)")
    return hits[0]


def measure(spec: dict[str, Any]) -> list[float]:
    """The values a selector reads from the records, one per matching record.

    A selector names `run` (a run directory), `file` (a glob inside it), `where` (field values a
    record must have), `field` (the value read) and optionally `over` (field values that pick, in
    the same file, the record whose `field` divides it: `over: {method: ar_res}` is "× the
    resident AR of the same cell"). `agg: pooled` takes `field: [numerator, denominator]` and
    returns one value, sum over sum (tok/s pooled over prompts).
    """
    where = spec.get("where") or {}
    out: list[float] = []
    num = den = 0.0
    pooled = spec.get("agg") == "pooled"
    for path in _files(spec):
        records = _load(path)
        hits = [r for r in records if _match(r, where)]
        for rec in hits:
            if pooled:
                num += float(rec[spec["field"][0]])
                den += float(rec[spec["field"][1]])
                continue
            if spec["field"] not in rec or rec[spec["field"]] is None:
                raise SelectorError(f"{path.relative_to(ROOT)}: no {spec['field']!r} in a record matching {where}")
            value = float(rec[spec["field"]])
            if "over" in spec:
                ref = _one(records, {**where, **spec["over"]}, path)
                value /= float(ref[spec["field"]])
            out.append(value)
    if pooled:
        if den <= 0:
            raise SelectorError(f"{spec['run']}/{spec['file']}: nothing to pool for {where}")
        return [num / den]
    if not out:
        raise SelectorError(f"{spec['run']}/{spec['file']}: no record matches {where}")
    if spec.get("agg", "one") in ("one", "pooled") and len(out) != 1:
        raise SelectorError(f"{spec['run']}/{spec['file']}: {len(out)} records match {where} (agg one wants 1)")
    return out


def value_text(spec: dict[str, Any]) -> str:
    """The selector's values as published: one number, or the range lo–hi, with its unit."""
    values = measure(spec)
    digits, unit = spec.get("digits", 2), spec.get("unit", "")
    lo, hi = f"{min(values):,.{digits}f}", f"{max(values):,.{digits}f}"
    return (lo if lo == hi else f"{lo}–{hi}") + unit


def _link(spec: dict[str, Any]) -> str:
    files = _files(spec)
    target = files[0] if len(files) == 1 else RESULTS / spec["run"]
    rel = target.relative_to(ROOT).as_posix()
    return rel + "/" if target.is_dir() else rel


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _short(commit: str | None) -> str:
    if not commit:
        return "–"
    if commit == "unknown":
        return "unknown"
    return f"`{commit[:7]}`" + ("-dirty" if commit.endswith("-dirty") else "")


def headline(manifest: dict[str, Any]) -> str:
    """The headline table (README and RESULTS.md): every figure a link to the record it is read from."""
    h = manifest["headline"]
    out = [f"| setting | result | {' | '.join(h['columns'])} |",
           "|---|---|" + "---|" * len(h["columns"])]
    for row in h["rows"]:
        cells = []
        for spec in row["cells"]:
            cells.append("–" if spec is None else f"[{value_text(spec)}]({_link(spec)})")
        out.append(f"| {_cell(manifest['hardware'][row['hardware']]['short'])} | {_cell(row['label'])} | "
                   + " | ".join(cells) + " |")
    out += ["", _cell(h["note"]).strip()]
    return "\n".join(out) + "\n"


def claim_text(claim: dict[str, Any]) -> str:
    """A claim's sentence with its `{name}` values read from the records (typed text where it has none)."""
    values = claim.get("values") or {}
    if not values:
        return claim["claim"]
    return claim["claim"].format_map({k: value_text(v) for k, v in values.items()})


def render(manifest: dict[str, Any]) -> str:
    runs = {r["run"]: r for r in manifest["runs"]}
    out = [
        "# Results",
        "",
        "<!-- generated by scripts/results_page.py from experiments/results/manifest.yaml: edit that, not this -->",
        "",
        "Every number FlashSpec publishes, with the records it comes from, the hardware, the command",
        "and the commit. This page is generated from `experiments/results/manifest.yaml` and the",
        "committed records by `python scripts/results_page.py`; `tests/test_manifest.py` fails when it",
        "(or README's headline table) is out of date. Figures in *Headline* and in sentences with a",
        "linked value are read from the records by the manifest's selectors; the other claims are the",
        "sentences committed with their records, each naming its run directories.",
        "",
        "## Headline",
        "",
        headline(manifest).rstrip("\n"),
        "",
        "## Hardware",
        "",
    ]
    for hw in manifest["hardware"].values():
        out.append(f"- **{hw['short']}**: {hw['long']}")
    figures: dict[str, list[dict[str, Any]]] = {}
    for f in manifest.get("figures") or []:
        figures.setdefault(f["section"], []).append(f)
    for sec in manifest["sections"]:
        out += ["", f"## {sec['title']}", "", sec["intro"].strip()]
        for f in figures.get(sec["id"], []):
            out += ["", f"![{f['caption']}]({REL}/{f['path']})", "", f"*{f['caption']}*"]
        out.append("")
        for c in manifest["claims"]:
            if c["section"] != sec["id"]:
                continue
            dirs = ", ".join(f"[`{r}`]({REL}/{r}/)" for r in c["runs"])
            hw = manifest["hardware"][c["hardware"]]["short"]
            out.append(f"- **{c['topic']}** ({hw}). {claim_text(c)}. Records: {dirs}.")
    out += [
        "",
        "## Run directories",
        "",
        "*provenance* is the `provenance.commit` field the records carry (`-dirty`: the run had",
        "uncommitted changes); *source* is `provenance.config.source_commit` where a GPU runner",
        "recorded the code it ran; *committed in* is the commit that added the records, whose code is",
        f"what ran. Branch `{manifest['history_branch']}` (= `{manifest['history_commit'][:7]}`, the",
        "tree before the clean-up) keeps what left this directory: logs, kernel notes, rejected kernel",
        "variants, probe scripts, superseded runs and the large per-prompt records whose aggregates are",
        f"kept here (column *on lab-notebook*). The directory stays under "
        f"{manifest['max_tracked_bytes'] / 1e6:g} MB.",
        "",
        "| run directory | provenance | source | committed in | command | on lab-notebook |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        lab = "<br>".join(f"`{Path(p).name}`" for p in r.get("lab_notebook") or [])
        out.append(f"| [`{name}`]({REL}/{name}/) | {_short(r.get('provenance_commit'))} | "
                   f"{_short(r.get('source_commit'))} | {_short(r.get('committed_in'))} | "
                   f"{_cell(r['command'])} | {lab} |")
    return "\n".join(out) + "\n"


def with_headline(readme: str, manifest: dict[str, Any]) -> str:
    """README.md with the text between its headline markers replaced by the headline table."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1 or readme.index(BEGIN) > readme.index(END):
        raise SelectorError(f"README.md must hold one {BEGIN} ... {END} block")
    head, rest = readme.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{headline(manifest)}{END}{tail}"


def load_manifest() -> dict[str, Any]:
    return yaml.safe_load((RESULTS / "manifest.yaml").read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare, do not write")
    a = ap.parse_args(argv)
    manifest = load_manifest()
    wanted = {PAGE: render(manifest), README: with_headline(README.read_text(), manifest)}
    stale = [p for p, text in wanted.items() if not p.is_file() or p.read_text() != text]
    if a.check:
        for p in stale:
            print(f"{p.name} is stale: run python scripts/results_page.py", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(wanted[p])
    return 0


if __name__ == "__main__":
    sys.exit(main())
