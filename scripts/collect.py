#!/usr/bin/env python
"""Collect run records (JSONL) and job metrics from Hydra run/sweep directories into tables.

    python scripts/collect.py outputs/ [more dirs or .jsonl files] -o outputs/results.parquet

Every ``*.jsonl`` and ``*.jsonl.gz`` under the given paths is read (``wandb/`` and hidden
folders skipped). A record's job dir is its nearest ancestor holding ``.hydra/config.yaml``;
its sweep dir is the nearest ancestor of the job dir holding Hydra's ``multirun.yaml``. Added
columns: ``run_dir``, ``sweep_dir``, ``overrides`` (the job's overrides joined by spaces), one
``ov.<key>`` column per override key, ``swept`` (the overrides whose values differ between the
jobs of the sweep, e.g. ``bandit=ucb1``; empty outside a sweep), ``commit``, ``hardware``,
``seed`` (from provenance; the full block stays as JSON in ``provenance``).

Tables written (each as parquet and as CSV, lists and dicts as JSON text in the CSV):

* ``-o`` (``results.parquet``): one row per decode record (method, prompt, turn).
* ``<stem>_<experiment>.parquet``: records of other experiments, one table per experiment.
* ``<stem>_jobs.parquet``: one row per (sweep, job, dataset, method) of every job that wrote a
  ``job_metrics.json`` (experiment=decode): ``role`` (the metric prefix: ``spec``, ``ar``,
  ``ref_full_head``, ``arm/<arm>``, ``extra/<policy>``, ``hf_*``), ``method`` (the records'
  method name of that role), the role's ``alpha, tau, tps, decode_tps, speedup, step_p50_s,
  step_p99_s``, and the job's own metrics on every row of the job (``rho_tau, nu, kappa,
  rho_tps_pred, rho_tps_meas, regret/final, arm_picks/<arm>, arm_mean_reward/<arm>,
  head/<key>``), with the job's ``ov.<key>`` and ``swept`` columns.
* ``<stem>_summary.parquet``: per (sweep, job, dataset, method) of the decode records: records,
  median TPS and decode TPS, τ, α, median speedup. Jobs of a sweep stay apart (a swept value is
  never pooled away); it is printed too.

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
from flashspec.records import RUN_CONFIG_HISTORY, DecodeRecord, read_records

DECODE = "decode"
BASELINE = "ar"
JOB_METRICS = "job_metrics.json"
JOBS, SUMMARY = "jobs", "summary"   # table names beside -o: <stem>_jobs, <stem>_summary
ROLE_STATS = ("alpha", "tau", "tps", "decode_tps", "speedup", "step_p50_s", "step_p99_s")
GROUP_KEYS = ["sweep_dir", "run_dir", "swept", "dataset", "method"]
PAIR_KEYS = ["run_dir", "dataset", "prompt_id", "turn", "temperature", "batch_size"]
# the decode records' schema (flashspec.records.DecodeRecord), then the provenance block
DECODE_COLUMNS = [*DecodeRecord.columns(), "provenance"]


def record_files(paths: Iterable[Path]) -> list[Path]:
    """Every JSONL file under ``paths``, gzipped ones too (committed records are), files taken as
    given; skipping wandb/ and dot dirs and each run directory's history of replaced configs
    (JSONL too, but no records)."""
    def is_records(f: Path) -> bool:
        return f.name.endswith((".jsonl", ".jsonl.gz"))
    return [f for f in find_files(paths, "*.jsonl*", take_files=is_records)
            if is_records(f) and f.name != RUN_CONFIG_HISTORY]


def metric_files(paths: Iterable[Path]) -> list[Path]:
    """Every ``job_metrics.json`` under ``paths`` (or given as a path), skipping wandb/ and dot dirs."""
    return find_files(paths, JOB_METRICS, take_files=lambda f: f.name == JOB_METRICS)


def find_files(paths: Iterable[Path], pattern: str, take_files) -> list[Path]:
    """Files matching ``pattern`` under the directories of ``paths`` (not inside wandb/ or dot
    dirs) and the files of ``paths`` that ``take_files`` accepts."""
    found: list[Path] = []
    for root in paths:
        if root.is_file():
            if take_files(root):
                found.append(root)
            continue
        if not root.is_dir():
            raise FlashSpecError(f"{root} does not exist; pass run or sweep directories")
        for f in sorted(root.rglob(pattern)):
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
    """The Hydra sweep dir holding ``job`` (its nearest ancestor with ``multirun.yaml``), if it
    was part of a multirun. Nearest ancestor, not parent: sweeps made before the job folder name
    escaped '/' nest jobs like ``0_head.rank=d/8`` one level deeper."""
    if job is None:
        return None
    for d in job.parents:
        if (d / "multirun.yaml").is_file():
            return d
    return None


def job_info(job: Path | None) -> dict[str, Any]:
    """Columns shared by all records of a job: dirs, overrides, experiment name from config."""
    overrides: list[str] = []
    experiment = dataset = None
    if job is not None:
        ov_file = job / ".hydra" / "overrides.yaml"
        overrides = [str(o) for o in (_yaml(ov_file) or [])] if ov_file.is_file() else []
        cfg = _yaml(job / ".hydra" / "config.yaml")
        cfg = cfg if isinstance(cfg, dict) else {}
        experiment = (cfg.get("experiment") or {}).get("name")
        dataset = (cfg.get("dataset") or {}).get("name")
    sweep = sweep_dir(job)
    info: dict[str, Any] = {"run_dir": str(job) if job else None,
                            "sweep_dir": str(sweep) if sweep else None,
                            "overrides": " ".join(overrides), "_experiment": experiment,
                            "_dataset": dataset}
    info.update(override_columns(overrides))
    return info


def _yaml(path: Path) -> Any:
    """A job's Hydra YAML file (a mapping or a list); a damaged one is one line naming it."""
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise FlashSpecError(f"{path} is unreadable ({type(e).__name__}); restore it or leave "
                             "that job out") from None
    if data is not None and not isinstance(data, (dict, list)):
        raise FlashSpecError(f"{path} holds {type(data).__name__}, not Hydra's YAML")
    return data


def override_columns(overrides: Iterable[str]) -> dict[str, str]:
    """``{'ov.<key>': value}`` for Hydra overrides like ``bandit=ucb1`` or ``+x.y=3``."""
    out = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep:
            out[f"ov.{key.lstrip('+~')}"] = value
    return out


def swept_labels(infos: Iterable[dict[str, Any]]) -> dict[str, str]:
    """``run_dir -> 'key=value,...'``: per sweep, the overrides whose values differ between its
    jobs (what the sweep varied); empty for a job outside a sweep or a sweep of one job."""
    by_sweep: dict[str, list[dict[str, Any]]] = {}
    for info in infos:
        if info["sweep_dir"] is not None:
            by_sweep.setdefault(info["sweep_dir"], []).append(info)
    labels = {}
    for jobs in by_sweep.values():
        keys = sorted({k for j in jobs for k in j if k.startswith("ov.")})
        varying = [k for k in keys if len({j.get(k) for j in jobs}) > 1]
        for j in jobs:
            labels[j["run_dir"]] = ",".join(f"{k[3:]}={j.get(k)}" for k in varying)
    return labels


class Jobs:
    """Job columns (:func:`job_info` and ``swept``) of every job dir met, read once each."""

    def __init__(self, paths: Iterable[Path]) -> None:
        paths = list(paths)
        self.infos: dict[Path, dict[str, Any]] = {}
        for f in record_files(paths) + metric_files(paths):
            job = job_dir(f)
            if job is not None and job not in self.infos:
                self.infos[job] = job_info(job)
        self.swept = swept_labels(self.infos.values())

    def get(self, file: Path) -> dict[str, Any]:
        """Columns of the job holding ``file``; outside a Hydra job dir, its folder is the run."""
        job = job_dir(file)
        if job is None:
            return {**job_info(None), "run_dir": str(file.resolve().parent), "swept": ""}
        info = self.infos.get(job) or self.infos.setdefault(job, job_info(job))
        return {**info, "swept": self.swept.get(info["run_dir"], "")}


def public(info: dict[str, Any]) -> dict[str, Any]:
    """Job columns without the private (underscored) ones."""
    return {k: v for k, v in info.items() if not k.startswith("_")}


def iter_rows(paths: Iterable[Path], jobs: Jobs | None = None) -> Iterator[dict[str, Any]]:
    """Every record of every file, with job columns and flattened provenance."""
    paths = list(paths)
    jobs = jobs or Jobs(paths)
    for f in record_files(paths):
        info = jobs.get(f)
        for rec in read_records(f, experiment=info["_experiment"]):   # unusable lines: warned, skipped
            row = {**rec, **public(info)}
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
    """One DataFrame of records per experiment name, plus ``jobs`` (one row per job and method
    from the jobs' ``job_metrics.json``) and ``summary`` (of the decode records) where there
    are any."""
    paths = list(paths)
    jobs = Jobs(paths)
    rows = list(iter_rows(paths, jobs))
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
    job_rows = list(iter_job_rows(paths, jobs, by_exp.get(DECODE, [])))
    if job_rows:
        tables[JOBS] = arrow_safe(pd.DataFrame(job_rows))
    if DECODE in tables:
        tables[SUMMARY] = summarize(tables[DECODE])
    return tables


# ----------------------------------------------------------------------------- job metrics
def split_metrics(metrics: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """``({role: {stat: value}}, job-level metrics)`` of one job's flat metric keys: a key
    ``<role>/<stat>`` with ``stat`` in :data:`ROLE_STATS` belongs to its role (``spec``,
    ``arm/<arm>``, ...); every other key (``rho_tau``, ``regret/final``, ``head/rank``,
    ``arm_picks/<arm>``, ...) to the job."""
    roles: dict[str, dict[str, Any]] = {}
    job: dict[str, Any] = {}
    for key, value in metrics.items():
        role, sep, stat = key.rpartition("/")
        if sep and stat in ROLE_STATS:
            roles.setdefault(role, {})[stat] = value
        else:
            job[key] = value
    return roles, job


def role_methods(roles: Iterable[str], methods: Iterable[str]) -> dict[str, str | None]:
    """The method name (as in the records) of each metric role of a job; None where the job's
    records do not tell. ``spec`` is the one speculative method no other role claims."""
    methods = list(dict.fromkeys(methods))
    out: dict[str, str | None] = {}
    for role in roles:
        if role == "spec":
            continue
        if role.startswith("arm/"):
            want = [f"spec:{role[4:]}"]
        elif role.startswith("extra/"):
            want = [m for m in methods if m.startswith(f"spec:bandit:{role[6:]}")]
        elif role == "ref_full_head":
            want = [m for m in methods if m.startswith("ref_full_head:")]
        else:
            want = [role]
        out[role] = next((m for m in want if m in methods), None)
    if "spec" in roles:
        left = [m for m in methods if m.startswith("spec:") and m not in out.values()]
        out["spec"] = left[0] if len(left) == 1 else None
    return out


def iter_job_rows(paths: Iterable[Path], jobs: Jobs, records: list[dict[str, Any]]
                  ) -> Iterator[dict[str, Any]]:
    """One row per (job, role) of every ``job_metrics.json``: the job's columns, its dataset,
    the role and its method, the role's statistics and the job's own metrics."""
    by_run: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_run.setdefault(r["run_dir"], []).append(r)
    for f in metric_files(paths):
        info = jobs.get(f)
        try:
            metrics = json.loads(f.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FlashSpecError(f"{f} is not JSON ({e}); rerun the job to rewrite it") from e
        if not isinstance(metrics, dict):
            raise FlashSpecError(f"{f} holds JSON {type(metrics).__name__}, not the job's metrics; "
                                 "rerun the job to rewrite it")
        roles, job_level = split_metrics(metrics)
        recs = by_run.get(info["run_dir"], [])
        names = role_methods(roles, (r["method"] for r in recs))
        for role, stats in roles.items():
            mine = [r for r in recs if r["method"] == names[role]]
            datasets = sorted({str(r["dataset"]) for r in mine})
            dataset = info["_dataset"] or (",".join(datasets) if datasets else None)
            first = mine[0] if mine else (recs[0] if recs else {})
            yield {**public(info), "dataset": dataset, "role": role, "method": names[role],
                   "n_records": len(mine), **{k: stats.get(k) for k in ROLE_STATS},
                   **job_level, "metrics_file": str(f.resolve()),
                   **provenance_columns(first.get("provenance"))}


def table_path(out: Path, name: str) -> Path:
    """Where table ``name`` (an experiment, ``jobs`` or ``summary``) goes, given the decode
    table's path ``out``."""
    return out if name == DECODE else out.with_name(f"{out.stem}_{name}{out.suffix}")


def write_tables(tables: dict[str, pd.DataFrame], out: Path) -> dict[str, Path]:
    """Write each table as parquet and as CSV beside it; returns the parquet paths."""
    out.parent.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, df in tables.items():
        path = table_path(out, name)
        df.to_parquet(path, index=False)
        csv_safe(df).to_csv(path.with_suffix(".csv"), index=False)
        written[name] = path
    return written


def csv_safe(df: pd.DataFrame) -> pd.DataFrame:
    """Array cells (lists after arrow_safe) as JSON text, one cell each."""
    df = df.copy()
    for col in df.columns:
        if df[col].dtype == object and any(isinstance(v, (list, tuple)) for v in df[col]):
            df[col] = [json.dumps(v) if isinstance(v, (list, tuple)) else v for v in df[col]]
    return df


def group_keys(df: pd.DataFrame) -> list[str]:
    """What a summary row stands for: sweep, job (run dir), its swept values, dataset, method."""
    return [k for k in GROUP_KEYS if k in df.columns]


def speedups(df: pd.DataFrame) -> pd.DataFrame:
    """Per-record TPS / TPS of the ``ar`` baseline on the same prompt in the same run."""
    keys = [k for k in PAIR_KEYS if k in df.columns]
    base = df[df["method"] == BASELINE][keys + ["tps"]].rename(columns={"tps": "tps_ar"})
    base = base.groupby(keys, dropna=False, as_index=False)["tps_ar"].median()
    merged = df.merge(base, on=keys, how="inner")
    merged["speedup"] = merged["tps"] / merged["tps_ar"]
    return merged


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per (sweep, job, dataset, method): records, median TPS, decode TPS, τ, α (ratio of sums),
    speedup. Jobs stay apart: two values of a swept setting are never pooled into one row."""
    keys = group_keys(df)
    groups = df.groupby(keys, sort=True, dropna=False)
    out = pd.DataFrame({"records": groups.size(), "tps_median": groups["tps"].median(),
                        "decode_tps_median": groups["decode_tps"].median()})
    out["tau"] = groups.apply(_weighted_tau, include_groups=False)
    out["alpha"] = groups.apply(_alpha, include_groups=False)
    sp = speedups(df)
    out["speedup_median"] = sp.groupby(keys, dropna=False)["speedup"].median() \
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
    for name, path in written.items():
        what = "rows" if name in (JOBS, SUMMARY) else "records"
        print(f"{name}: {len(tables[name])} {what} -> {path} (+ .csv)")
    if SUMMARY in tables:
        summary = tables[SUMMARY].drop(columns=["sweep_dir", "run_dir"], errors="ignore")
        with pd.option_context("display.width", 160, "display.max_columns", 20):
            print(summary.to_string(index=False, float_format="%.3f"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
