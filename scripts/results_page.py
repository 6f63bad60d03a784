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
import re
import statistics
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


def _tables(text: str) -> list[dict[str, Any]]:
    """The rows of the whitespace-aligned tables a run printed (summary.txt, a log's table).

    A table is a line of column names followed by rows of as many columns (a dashed rule under
    the names is skipped); a row is one record keyed by the names, numbers read as numbers and
    `-` or `NaN` as missing, so a selector reads a printed table as it reads a .jsonl file.
    """
    out: list[dict[str, Any]] = []
    lines = [line.split() for line in text.splitlines()]
    i = 0
    while i < len(lines):
        names = lines[i]
        rows = [r for r in lines[i + 1:i + 3] if r and not _rule(r)]
        if not (len(names) > 1 and all(_NAME.fullmatch(t) for t in names) and rows
                and len(rows[0]) == len(names)):
            i += 1
            continue
        i += 1
        while i < len(lines) and lines[i] and not all(_NAME.fullmatch(t) for t in lines[i]):
            if _rule(lines[i]):
                i += 1
                continue
            if len(lines[i]) != len(names):
                break
            out.append({k: _scalar(v) for k, v in zip(names, lines[i])})
            i += 1
    return out


_NAME = re.compile(r"[A-Za-z_][\w/]*")


def _rule(tokens: list[str]) -> bool:
    """A dashed line under a table's column names."""
    return all(set(t) <= {"-"} for t in tokens)


def _scalar(token: str) -> Any:
    if token in ("-", "NaN", "nan"):
        return None
    try:
        return float(token)
    except ValueError:
        return token


def _text(path: Path) -> str:
    return gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()


def _load(path: Path) -> list[dict[str, Any]]:
    """The records of one file: a .json object is one record, a .jsonl line one record, a row of a
    printed table (any other text file) one record; .gz read too."""
    raw = _text(path)
    name = path.name[:-3] if path.suffix == ".gz" else path.name
    if name.endswith(".json"):
        return [json.loads(raw)]
    if name.endswith(".jsonl"):
        return [json.loads(line) for line in raw.splitlines() if line.strip()]
    return _tables(raw)


def _runs(spec: dict[str, Any]) -> list[str]:
    """The run directories a selector reads: `run` is one, or a list (repeats of one bench)."""
    return spec["run"] if isinstance(spec["run"], list) else [spec["run"]]


def _files(spec: dict[str, Any]) -> list[Path]:
    files = sorted(p for run in _runs(spec) for p in (RESULTS / run).glob(spec["file"]) if p.is_file())
    if not files:
        raise SelectorError(f"no file {spec['file']!r} under {REL}/{spec['run']}")
    return files


def _match(rec: dict[str, Any], where: dict[str, Any]) -> bool:
    """`where: {k: null}` asks for a record without k (or with k null), `{k: [a, b]}` for k a or b."""
    return all(rec.get(k) is None if v is None else rec.get(k) in v if isinstance(v, list)
               else (k in rec and rec[k] == v) for k, v in where.items())


def _one(records: list[dict[str, Any]], where: dict[str, Any], path: Path) -> dict[str, Any]:
    hits = [r for r in records if _match(r, where)]
    if len(hits) != 1:
        raise SelectorError(f"{path.relative_to(ROOT)}: {len(hits)} records match {where} (want 1)")
    return hits[0]


def _field(rec: dict[str, Any], field: str | list[str], where: dict[str, Any], path: Path) -> float:
    """A record's `field`, or with `field: [a, b]` its a / b (a share the record holds as two counts)."""
    if isinstance(field, list):
        return _field(rec, field[0], where, path) / _field(rec, field[1], where, path)
    value: Any = rec.get(field)
    if field not in rec and "." in field:   # verify_ms.7 is rec["verify_ms"]["7"], alpha_by_depth.0 its [0]
        value = rec
        for key in field.split("."):
            if isinstance(value, list) and key.isdigit():
                value = value[int(key)] if int(key) < len(value) else None
            else:
                value = value.get(key) if isinstance(value, dict) else None
    if value is None:
        raise SelectorError(f"{path.relative_to(ROOT)}: no {field!r} in a record matching {where}")
    return float(value)


# One value from many: median over prompts, mean over seeds; `range` keeps them all (lo–hi).
AGGREGATES = {"median": statistics.median, "mean": statistics.fmean, "min": min, "max": max}


def measure(spec: dict[str, Any]) -> list[float]:
    """The values a selector reads from the records, one per matching record.

    A selector names `run` (a run directory, or a list of them), `file` (a glob inside it),
    `where` (field values a record must have; null: the record lacks the field; a list: any of
    its values), `field` (the value read; `[a, b]`: the record's a / b) and optionally `over` (field values that pick, in the same
    file, the record whose `field` divides it: `over: {method: ar_res}` is "× the resident AR of
    the same cell"; `pair: [prompt_id, turn]` divides each prompt's value by the same prompt's,
    for a median over prompts of per-prompt speedups). `agg: pooled` takes `field: [numerator,
    denominator]` and returns one value, sum over sum (tok/s pooled over prompts); `agg: median |
    mean | min | max` returns one value of the matches; `agg: range` all of them. `pattern`
    (a regular expression with one group) reads the numbers it matches in the files' text instead
    of records, for what a run only printed.
    `ratio: [selector, selector]` is the first's one value over the second's (a ratio of two pooled
    values, or of two runs), `difference: [selector, selector]` the first less the second (steps
    launched past the end: launched less live). Each value is multiplied by `scale` (100 for a
    percentage, 1000 for ms) and `offset` added (τ is 1 + accepted drafts per step: pooled
    [n_accepted, steps], offset 1), `abs: true` takes its size, before `agg` (a prediction's
    largest relative error: field [predicted, measured], scale 100, offset -100, abs, agg max).
    A `field` with a dot that is no key of the record is a path into nested objects and lists
    (verify_ms.7, alpha_by_depth.0); a field holding a list gives one value per element.
    """
    if "ratio" in spec or "difference" in spec:
        a, b = (_single(s) for s in spec.get("ratio") or spec["difference"])
        return [(a / b if "ratio" in spec else a - b) * spec.get("scale", 1) + spec.get("offset", 0)]
    where = spec.get("where") or {}
    agg = spec.get("agg", "one")
    if agg not in AGGREGATES and agg not in ("one", "range", "pooled"):
        raise SelectorError(f"unknown agg {agg!r}")
    out: list[float] = []
    num = den = 0.0
    for path in _files(spec):
        if "pattern" in spec:
            out += [float(m.replace(",", "")) for m in re.findall(spec["pattern"], _text(path))]
            continue
        records = _load(path)
        for rec in (r for r in records if _match(r, where)):
            if agg == "pooled":
                num += _field(rec, spec["field"][0], where, path)
                den += _field(rec, spec["field"][1], where, path)
                continue
            if isinstance(spec["field"], str) and isinstance(rec.get(spec["field"]), list) and "over" not in spec:
                out += [float(v) for v in rec[spec["field"]] if v is not None]
                continue
            value = _field(rec, spec["field"], where, path)
            if "over" in spec:
                same = {k: rec.get(k) for k in spec.get("pair") or []}
                value /= _field(_one(records, {**where, **spec["over"], **same}, path), spec["field"], where, path)
            out.append(value)
    if agg == "pooled":
        if den <= 0:
            raise SelectorError(f"{spec['run']}/{spec['file']}: nothing to pool for {where}")
        out = [num / den]
    if not out:
        raise SelectorError(f"{spec['run']}/{spec['file']}: no record matches {where or spec.get('pattern')}")
    out = [v * spec.get("scale", 1) + spec.get("offset", 0) for v in out]
    if spec.get("abs"):
        out = [abs(v) for v in out]
    if agg in AGGREGATES:
        out = [AGGREGATES[agg](out)]
    if agg == "one" and len(out) != 1:
        raise SelectorError(f"{spec['run']}/{spec['file']}: {len(out)} records match {where} (agg one wants 1)")
    return out


def _single(spec: dict[str, Any]) -> float:
    values = measure(spec)
    if len(values) != 1:
        raise SelectorError(f"{spec['run']}/{spec['file']}: a ratio's term has {len(values)} values (want 1)")
    return values[0]


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
    """A claim's sentence with its `{name}` values read from the records."""
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
        "(or README's headline table) is out of date. Figures in *Headline* and the measured numbers",
        "of the claims are read from the records by the manifest's selectors; the numbers left in a",
        "claim's words are its settings (seeds, prompt counts, shapes, γ, batch). Each claim names its",
        "run directories.",
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
