#!/usr/bin/env python
"""Collect run records (JSONL) from Hydra run/sweep directories into parquet tables.

    python scripts/collect.py outputs/ [more dirs or .jsonl files] -o outputs/results.parquet

Every ``*.jsonl`` under the given paths is read (``wandb/`` and hidden folders skipped). A
record's job dir is its nearest ancestor holding ``.hydra/config.yaml``; its sweep dir is the job
dir's parent when that holds Hydra's ``multirun.yaml``. Added columns: ``run_dir``, ``sweep_dir``,
``overrides`` (the job's overrides joined by spaces), one ``ov.<key>`` column per override key,
``commit``, ``hardware``, ``seed`` (from provenance; the full block stays as JSON in
``provenance``). Decode records go to ``-o``; records of other experiments (grouped by their
``experiment`` field) go to ``<stem>_<experiment>.parquet`` beside it. A per (dataset, method)
summary of the decode records is printed.

Speedup pairs each record with the ``ar`` record of the same prompt, turn, temperature and batch
size in the same run dir (DESIGN: same run, same hardware), then takes the median over prompts.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator

import pandas as pd
import pyarrow as pa
import yaml

from flashspec.errors import FlashSpecError
from flashspec.metrics import alpha, tau
from flashspec.records import read_records

DECODE = "decode"
BASELINE = "ar"
PAIR_KEYS = ["run_dir", "dataset", "prompt_id", "turn", "temperature", "batch_size"]
DECODE_COLUMNS = ["experiment", "method", "dataset", "prompt_id", "domain", "turn",
                  "n_prompt_tokens", "n_new_tokens", "wall_s", "decode_s", "tps", "decode_tps",
                  "steps", "n_proposed", "n_accepted", "alpha", "tau", "accept_hist", "arms",
                  "gamma", "batch_size", "temperature", "text", "provenance"]


def record_files(paths: Iterable[Path]) -> list[Path]:
    """Every JSONL file under ``paths`` (files are taken as given), skipping wandb/ and dot dirs."""
    found: list[Path] = []
    for root in paths:
        if root.is_file():
            found.append(root)
            continue
        if not root.is_dir():
            raise FlashSpecError(f"{root} does not exist; pass run or sweep directories")
        for f in sorted(root.rglob("*.jsonl")):
            parts = f.relative_to(root).parts[:-1]
            if not any(p.startswith(".") or p == "wandb" for p in parts):
                found.append(f)
    return found


def job_dir(path: Path) -> Path | None:
    """Nearest ancestor of a record file that is a Hydra job dir."""
    for d in path.resolve().parents:
        if (d / ".hydra" / "config.yaml").is_file():
            return d
    return None


def sweep_dir(job: Path | None) -> Path | None:
    """The Hydra sweep dir holding ``job``, if it was part of a multirun."""
    if job is not None and (job.parent / "multirun.yaml").is_file():
        return job.parent
    return None


def job_info(job: Path | None) -> dict[str, Any]:
    """Columns shared by all records of a job: dirs, overrides, experiment name from config."""
    overrides: list[str] = []
    experiment = None
    if job is not None:
        ov_file = job / ".hydra" / "overrides.yaml"
        overrides = [str(o) for o in (yaml.safe_load(ov_file.read_text()) or [])] \
            if ov_file.is_file() else []
        cfg = yaml.safe_load((job / ".hydra" / "config.yaml").read_text()) or {}
        experiment = (cfg.get("experiment") or {}).get("name")
    sweep = sweep_dir(job)
    info: dict[str, Any] = {"run_dir": str(job) if job else None,
                            "sweep_dir": str(sweep) if sweep else None,
                            "overrides": " ".join(overrides), "_experiment": experiment}
    info.update(override_columns(overrides))
    return info


def override_columns(overrides: Iterable[str]) -> dict[str, str]:
    """``{'ov.<key>': value}`` for Hydra overrides like ``bandit=ucb1`` or ``+x.y=3``."""
    out = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep:
            out[f"ov.{key.lstrip('+~')}"] = value
    return out


def iter_rows(paths: Iterable[Path]) -> Iterator[dict[str, Any]]:
    """Every record of every file, with job columns and flattened provenance."""
    cache: dict[Path | None, dict[str, Any]] = {}
    for f in record_files(paths):
        job = job_dir(f)
        if job not in cache:
            cache[job] = job_info(job)
        info = cache[job]
        if info["run_dir"] is None:  # records written outside a Hydra job dir: one run per folder
            info = {**info, "run_dir": str(f.resolve().parent)}
        for rec in read_records(f):
            row = {**rec, **{k: v for k, v in info.items() if k != "_experiment"}}
            row["experiment"] = rec.get("experiment") or info["_experiment"] or "unknown"
            row["record_file"] = str(f.resolve())
            row.update(provenance_columns(rec.get("provenance")))
            yield row


def provenance_columns(prov: Any) -> dict[str, Any]:
    """Commit, hardware (GPU name or CPU platform) and seed out of a provenance block."""
    if not isinstance(prov, dict):
        return {}
    hw = prov.get("hardware") or {}
    hardware = hw.get("gpu") or (f"cpu:{hw.get('machine')}" if hw else None)
    return {"commit": prov.get("commit"), "hardware": hardware, "seed": prov.get("seed")}


def arrow_safe(df: pd.DataFrame) -> pd.DataFrame:
    """Dict columns become JSON text; object columns arrow cannot type become JSON too."""
    df = df.copy()
    for col in df.columns:
        if df[col].dtype != object:
            continue
        values = [None if isinstance(v, float) and math.isnan(v) else v for v in df[col].tolist()]
        needs_json = any(isinstance(v, dict) for v in values)
        if not needs_json:
            try:
                pa.array(values)
                df[col] = pd.Series(values, index=df.index, dtype=object)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
                needs_json = True
        if needs_json:
            df[col] = [None if v is None else json.dumps(v, sort_keys=True, default=str)
                       for v in values]
    return df


def collect(paths: Iterable[Path]) -> dict[str, pd.DataFrame]:
    """One DataFrame per experiment name."""
    rows = list(iter_rows(paths))
    if not rows:
        raise FlashSpecError("no records found; run e.g. `python run.py experiment=decode "
                             "smoke=true` first, then collect its outputs/ dir")
    by_exp: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_exp.setdefault(str(row["experiment"]), []).append(row)
    tables = {}
    for exp in sorted(by_exp):
        df = pd.DataFrame(by_exp[exp])
        if exp == DECODE:
            df = df.reindex(columns=list(dict.fromkeys(DECODE_COLUMNS + list(df.columns))))
        tables[exp] = arrow_safe(df)
    return tables


def table_path(out: Path, experiment: str) -> Path:
    """Where the table of ``experiment`` goes, given the decode table's path ``out``."""
    return out if experiment == DECODE else out.with_name(f"{out.stem}_{experiment}{out.suffix}")


def write_tables(tables: dict[str, pd.DataFrame], out: Path) -> dict[str, Path]:
    """Write each experiment's table as parquet; returns the paths."""
    out.parent.mkdir(parents=True, exist_ok=True)
    written = {}
    for exp, df in tables.items():
        path = table_path(out, exp)
        df.to_parquet(path, index=False)
        written[exp] = path
    return written


def speedups(df: pd.DataFrame) -> pd.DataFrame:
    """Per-record TPS / TPS of the ``ar`` baseline on the same prompt in the same run."""
    keys = [k for k in PAIR_KEYS if k in df.columns]
    base = df[df["method"] == BASELINE][keys + ["tps"]].rename(columns={"tps": "tps_ar"})
    base = base.groupby(keys, dropna=False, as_index=False)["tps_ar"].median()
    merged = df.merge(base, on=keys, how="inner")
    merged["speedup"] = merged["tps"] / merged["tps_ar"]
    return merged


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per (dataset, method): records, median TPS, decode TPS, τ, α (ratio of sums), speedup."""
    groups = df.groupby(["dataset", "method"], sort=True)
    out = pd.DataFrame({"records": groups.size(), "tps_median": groups["tps"].median(),
                        "decode_tps_median": groups["decode_tps"].median()})
    out["tau"] = groups.apply(_weighted_tau, include_groups=False)
    out["alpha"] = groups.apply(_alpha, include_groups=False)
    sp = speedups(df)
    out["speedup_median"] = sp.groupby(["dataset", "method"])["speedup"].median() \
        if len(sp) else float("nan")
    return out.reset_index()


def _weighted_tau(g: pd.DataFrame) -> float:
    """Tokens per target forward over the group's records that measure it (ratio of sums)."""
    if "tau" not in g:
        return float("nan")
    ok = g["tau"].notna()
    value = tau(int(g.loc[ok, "n_accepted"].sum()), int(g.loc[ok, "steps"].sum()))
    return float("nan") if value is None else value


def _alpha(g: pd.DataFrame) -> float:
    """Accepted / proposed draft tokens, as a ratio of sums."""
    value = alpha(int(g["n_accepted"].sum()), int(g["n_proposed"].sum()))
    return float("nan") if value is None else value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="run/sweep dirs or JSONL files")
    parser.add_argument("-o", "--out", type=Path, default=Path("outputs/results.parquet"),
                        help="decode table; other experiments go beside it")
    args = parser.parse_args(argv)
    try:
        tables = collect(args.paths)
        written = write_tables(tables, args.out)
    except FlashSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for exp, path in written.items():
        print(f"{exp}: {len(tables[exp])} records -> {path}")
    if DECODE in tables:
        with pd.option_context("display.width", 160, "display.max_columns", 20):
            print(summarize(tables[DECODE]).to_string(index=False, float_format="%.3f"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
