"""scripts/collect.py (records, jobs and summary tables; sweep folders) and
notebooks/decode_results.ipynb on records of a real smoke decode sweep."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pandas as pd
import pytest
import yaml
from omegaconf import OmegaConf

from flashspec.data import cache_dir
from flashspec.records import RecordWriter, read_records

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "decode_results.ipynb"
DATASETS = ("humaneval", "gsm8k")
SCHEMA = ["experiment", "method", "dataset", "prompt_id", "domain", "turn", "n_prompt_tokens",
          "n_new_tokens", "wall_s", "decode_s", "tps", "decode_tps", "steps", "n_proposed",
          "n_accepted", "alpha", "tau", "accept_hist", "arms", "gamma", "batch_size",
          "temperature", "text", "provenance"]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


collect = _script("collect")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A real two-job smoke decode sweep (ar vs speculative, humaneval and gsm8k) via run.py;
    without the references (each arm alone, the full head): nothing here reads them."""
    _script("prepare_data").prepare(cache_dir())
    out = tmp_path_factory.mktemp("decode") / "sweep"
    cmd = [sys.executable, "run.py", "-m", "experiment=decode", "smoke=true", "logger=disabled",
           "experiment.methods=[ar,spec]", "experiment.references=[]", "experiment.warmup=false",
           "head.rank=d/8",  # a '/' in a swept job's folder name
           f"dataset={','.join(DATASETS)}", f"hydra.sweep.dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"smoke decode sweep failed:\n{proc.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def results(sweep: Path) -> Path:
    out = sweep.parent / "collected" / "results.parquet"
    assert collect.main([str(sweep), "-o", str(out)]) == 0
    return out


@pytest.mark.slow
def test_collect_decode_sweep(sweep: Path, results: Path):
    df = pd.read_parquet(results)
    on_disk = [r for f in sweep.rglob("records.jsonl") for r in read_records(f)]
    assert len(df) == len(on_disk) > 0
    assert set(SCHEMA) <= set(df.columns)
    assert (df["experiment"] == "decode").all()
    assert set(df["dataset"]) == set(DATASETS)
    assert (df["ov.dataset"] == df["dataset"]).all()
    assert (df["sweep_dir"] == str(sweep.resolve())).all()
    assert df["run_dir"].nunique() == len(DATASETS)
    assert all(Path(d).parent == sweep.resolve() for d in df["run_dir"])   # head.rank=d/8: not nested
    assert set(df["swept"]) == {f"dataset={d}" for d in DATASETS}
    jobs = pd.read_parquet(results.with_name("results_jobs.parquet"))
    assert set(jobs["dataset"]) == set(DATASETS) and {"ar", "spec"} <= set(jobs["role"])
    assert (jobs["sweep_dir"] == str(sweep.resolve())).all() and jobs["method"].notna().all()
    assert df["overrides"].str.contains("experiment=decode").all()
    assert (df["tps"] > 0).all() and (df["n_new_tokens"] > 0).all()
    assert "ar" in set(df["method"]), "decode smoke must include the ar baseline for speedup"
    summary = collect.summarize(df)
    assert summary["records"].sum() == len(df)


@pytest.mark.slow
def test_speedup_pairs_each_prompt_with_its_ar_baseline(results: Path):
    df = pd.read_parquet(results)
    sp = collect.speedups(df)
    spec = sp[sp["method"] != "ar"]
    assert len(spec) > 0
    row = spec.iloc[0]
    base = df[(df["method"] == "ar") & (df["run_dir"] == row["run_dir"])
              & (df["prompt_id"] == row["prompt_id"]) & (df["turn"] == row["turn"])]
    assert row["speedup"] == pytest.approx(row["tps"] / base["tps"].median())
    assert (sp.loc[sp["method"] == "ar", "speedup"] == 1.0).all()


@pytest.mark.slow
def test_notebook_executes_and_saves_figures(results: Path, monkeypatch):
    import nbclient
    import nbformat
    monkeypatch.setenv("FLASHSPEC_RESULTS", str(results))
    monkeypatch.delenv("FLASHSPEC_SWEEP", raising=False)
    # the kernel imports this checkout's flashspec/, whatever is installed
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    first = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert f"{len(pd.read_parquet(results))} decode records" in first
    for name in ("results_tps.png", "results_tau.png", "results_speedup.png"):
        png = results.parent / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    speedup = pd.read_csv(results.parent / "results_speedup.csv", index_col="dataset")
    assert set(speedup.index) == set(DATASETS) and (speedup.to_numpy() > 0).all()


def test_collect_groups_other_experiments_and_reads_overrides(tmp_path: Path):
    """Non-decode records (here a kernel benchmark's) land in their own parquet beside -o."""
    job = tmp_path / "sweep" / "0_backend=triton"
    (job / ".hydra").mkdir(parents=True)
    (tmp_path / "sweep" / "multirun.yaml").write_text("hydra: {}\n")
    (job / ".hydra" / "config.yaml").write_text("experiment:\n  name: kernel_bench\n")
    (job / ".hydra" / "overrides.yaml").write_text("- backend=triton\n- +hardware.x=2\n")
    writer = RecordWriter(job / "records.jsonl")
    writer.write({"experiment": "kernel_bench", "V": 32000, "ms": [1.5, 1.25],
                  "extra": [1, 2], "provenance": {"commit": "c0", "seed": 3, "hardware": {"machine": "x86_64"}}})
    writer.write({"V": 65536, "ms": [2.5], "meta": {"a": 1}})
    with (job / "records.jsonl").open("a") as f:
        f.write('{"truncated": ')
    (job / "wandb").mkdir()
    (job / "wandb" / "junk.jsonl").write_text(json.dumps({"experiment": "junk"}) + "\n")
    out = tmp_path / "res" / "results.parquet"
    assert collect.main([str(tmp_path / "sweep"), "-o", str(out)]) == 0
    assert not out.exists()
    df = pd.read_parquet(tmp_path / "res" / "results_kernel_bench.parquet")
    assert df["V"].tolist() == [32000, 65536] and df["ms"].map(list).tolist() == [[1.5, 1.25], [2.5]]
    assert df["ov.backend"].tolist() == ["triton"] * 2 and df["ov.hardware.x"].tolist() == ["2"] * 2
    assert df["sweep_dir"].tolist() == [str((tmp_path / "sweep").resolve())] * 2
    assert df.loc[0, "commit"] == "c0" and df.loc[0, "hardware"] == "cpu:x86_64"
    assert json.loads(df.loc[1, "meta"]) == {"a": 1}
    assert list(df.loc[0, "extra"]) == [1, 2] and df.loc[1, "extra"] is None


def test_collect_reads_gzipped_records_beside_raw_ones(tmp_path: Path):
    """Committed records are gzipped (scripts/pack_run.py): a folder holding one raw and one
    gzipped file of decode records yields the rows of both."""
    import gzip
    rows = [{"experiment": "decode", "method": "ar", "dataset": d, "prompt_id": f"{d}/0", "turn": 0,
             "n_new_tokens": 8, "wall_s": 1.0} for d in ("humaneval", "gsm8k")]
    (tmp_path / "humaneval.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with gzip.open(tmp_path / "gsm8k.jsonl.gz", "wt") as f:
        f.write(json.dumps(rows[1]) + "\n")
    assert [f.name for f in collect.record_files([tmp_path])] == ["gsm8k.jsonl.gz", "humaneval.jsonl"]
    assert sorted(r["dataset"] for r in collect.iter_rows([tmp_path])) == ["gsm8k", "humaneval"]


def test_collect_without_records_fails_with_one_line(tmp_path: Path, capsys):
    assert collect.main([str(tmp_path), "-o", str(tmp_path / "r.parquet")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "experiment=decode" in err
    assert collect.main([str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_sweep_job_folder_escapes_slash():
    """conf/config.yaml's sweep subdir makes one folder per job even for ``head.rank=d/8``, and a
    name a file system takes however many overrides there are."""
    from experiments.resolvers import path_safe, register_resolvers
    register_resolvers()
    subdir = yaml.safe_load((ROOT / "conf" / "config.yaml").read_text())["hydra"]["sweep"]["subdir"]
    node = OmegaConf.create({"hydra": {"job": {"num": 3, "override_dirname": "bandit=ucb1,head.rank=d/8"},
                                       "sweep": {"subdir": subdir}}})
    assert node.hydra.sweep.subdir == "3_bandit=ucb1,head.rank=d%2F8"
    assert unquote(path_safe("a%2F/b")) == "a%2F/b"   # reversible
    long = ",".join(f"experiment.setting_{i}=value/{i}" for i in range(20))   # > 255 bytes
    name = path_safe(long)
    assert len(name.encode()) <= 200 and "/" not in name and name != path_safe(long + "x")
    assert name.startswith(path_safe(long)[:100]) and name == path_safe(long)


def _job(sweep: Path, name: str, overrides: list[str], dataset: str, metrics: dict,
         records: list[dict]) -> Path:
    """A job folder as run.py -m writes it: .hydra/, records.jsonl, job_metrics.json."""
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "config.yaml").write_text(
        yaml.safe_dump({"experiment": {"name": "decode"}, "dataset": {"name": dataset}}))
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    writer = RecordWriter(job / "records.jsonl")
    for r in records:
        writer.write(r)
    (job / "job_metrics.json").write_text(json.dumps(metrics))
    return job


def _rec(method: str, tps: float, n_accepted: int = 0, n_proposed: int = 0) -> dict:
    return {"experiment": "decode", "method": method, "dataset": "humaneval", "prompt_id": "p0",
            "turn": 0, "n_new_tokens": 8, "wall_s": 8 / tps, "decode_s": 8 / tps, "tps": tps,
            "decode_tps": tps, "steps": 4, "n_proposed": n_proposed, "n_accepted": n_accepted,
            "alpha": None, "tau": 2.0, "arms": [0, 1], "rewards": [1.0, 0.5], "batch_size": 1,
            "temperature": 0.0}


def test_collect_jobs_table_keeps_swept_values_apart(tmp_path: Path):
    """One row per (job, method) with the role's stats and the job's own metrics; swept values
    as columns; the summary never pools two jobs; sweep dir found for an escaped job folder and
    for one nested by an unescaped '/' (sweeps made before the escape)."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    metrics = {"ar/tps": 10.0, "spec/tps": 20.0, "spec/alpha": 0.5, "arm/ngram@3/tps": 15.0,
               "extra/thompson/tps": 18.0, "ref_full_head/tps": 19.0, "regret/final": 1.5,
               "arm_picks/ngram@3": 2, "arm_mean_reward/ngram@3": 0.75, "rho_tau": 0.9,
               "nu": 0.2, "head/kind": "lowrank", "head/rank": 72}
    methods = ["ar", "spec:bandit:ucb1", "spec:bandit:thompson", "spec:ngram@3",
               "ref_full_head:eagle@3"]
    for k, (name, rank) in enumerate([("0_bandit=ucb1,head.rank=d%2F8", "d/8"),
                                      ("1_bandit=ucb1,head.rank=d/16", "d/16")]):
        _job(sweep, name, ["bandit=ucb1", f"head.rank={rank}"], "humaneval",
             {**metrics, "spec/tps": 20.0 + k},
             [_rec(m, 10.0 + i + k, 2, 4) for i, m in enumerate(methods)])
    out = tmp_path / "res" / "results.parquet"
    assert collect.main([str(sweep), "-o", str(out)]) == 0
    jobs = pd.read_parquet(out.with_name("results_jobs.parquet"))
    assert len(jobs) == 2 * 5 and jobs["run_dir"].nunique() == 2
    assert (jobs["sweep_dir"] == str(sweep.resolve())).all()
    assert set(jobs["ov.head.rank"]) == {"d/8", "d/16"} and set(jobs["ov.bandit"]) == {"ucb1"}
    assert set(jobs["swept"]) == {"head.rank=d/8", "head.rank=d/16"}
    role_to_method = dict(zip(jobs["role"], jobs["method"]))
    assert role_to_method == {"ar": "ar", "spec": "spec:bandit:ucb1", "arm/ngram@3": "spec:ngram@3",
                              "extra/thompson": "spec:bandit:thompson",
                              "ref_full_head": "ref_full_head:eagle@3"}
    spec = jobs[jobs["role"] == "spec"].sort_values("swept")
    assert spec["tps"].tolist() == [21.0, 20.0] and (spec["alpha"] == 0.5).all()
    assert (jobs["rho_tau"] == 0.9).all() and (jobs["regret/final"] == 1.5).all()
    assert (jobs["head/rank"] == 72).all() and (jobs["arm_picks/ngram@3"] == 2).all()
    assert (jobs["dataset"] == "humaneval").all() and (jobs["n_records"] == 1).all()
    summary = pd.read_parquet(out.with_name("results_summary.parquet"))
    assert len(summary) == 2 * len(methods) and (summary["records"] == 1).all()
    assert set(summary["swept"]) == {"head.rank=d/8", "head.rank=d/16"}
    records = pd.read_parquet(out)
    assert (records["sweep_dir"] == str(sweep.resolve())).all()
    csv = pd.read_csv(out.with_name("results_jobs.csv"))
    assert len(csv) == len(jobs) and "arm_mean_reward/ngram@3" in csv.columns
    assert json.loads(pd.read_csv(out.with_suffix(".csv"))["arms"][0]) == [0, 1]
