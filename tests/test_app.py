"""The Hydra app as a user runs it: every experiment config, sweeps, launchers and bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
QWEN_DRAFTER = ("tests/test_registry_models.py::"
                "test_qwen_drafter_trains_and_runs_under_head_decode_and_decode")
# Experiment configs whose smoke run another test makes (with the same assertions and more):
# the glob(*) smoke test leaves them out instead of running them a second time.
SMOKED_ELSEWHERE = {"train_drafter": "tests/test_eagle.py::test_train_drafter_smoke",
                   "train_drafter_sampled": "tests/test_eagle.py::test_train_drafter_smoke",
                   # a registry model CI never downloads: its smoke run is
                   "head_decode_qwen": "tests/test_registry_models.py::test_head_decode_qwen_smoke",
                   "head_decode_qwen05": "tests/test_registry_models.py::test_head_decode_qwen_smoke",
                   "train_drafter_qwen": QWEN_DRAFTER, "head_decode_qwen_eagle": QWEN_DRAFTER,
                   "bench": "tests/test_bench.py::test_bench_smoke_every_method_equals_ar"}


def run_app(*overrides: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, "run.py", *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def records_in(directory: Path) -> list[dict]:
    return [json.loads(line) for f in directory.rglob("*.jsonl") if "wandb" not in f.parts
            for line in f.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_every_experiment_config_runs_tiny(tmp_path):
    """The glob(*) smoke test: `-m experiment=glob(*) smoke=true` runs every experiment config
    (but those in SMOKED_ELSEWHERE, whose own smoke test runs them)."""
    exclude = ",".join(sorted(SMOKED_ELSEWHERE))
    res = run_app("-m", f"experiment=glob(*,exclude=[{exclude}])", "smoke=true", "logger=disabled",
                  f"hydra.sweep.dir={tmp_path}", timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    jobs = {d: (d / ".hydra" / "overrides.yaml").read_text() for d in tmp_path.iterdir()
            if (d / ".hydra").is_dir()}
    ran = {e for e in EXPERIMENTS for text in jobs.values() if f"experiment={e}" in text}
    assert ran == set(EXPERIMENTS) - set(SMOKED_ELSEWHERE)
    assert set(SMOKED_ELSEWHERE) <= set(EXPERIMENTS)
    equal_checked = 0
    for job in jobs:
        recs = records_in(job)
        assert recs, f"{job.name} wrote no records"
        assert all("provenance" in r for r in recs), f"{job.name}: records without provenance"
        metrics = job / "job_metrics.json"
        if metrics.is_file():   # greedy fp32 decode jobs: every method of ours reproduces AR
            job_metrics = json.loads(metrics.read_text())
            equal = {k: v for k, v in job_metrics.items() if k.endswith("/greedy_equal")
                     and not k.startswith("hf_")}
            assert all(v == 1.0 for v in equal.values()), (job.name, equal)
            equal_checked += len(equal)
    assert equal_checked, "no decode job reported greedy_equal"


@pytest.mark.slow
def test_submitit_local_two_job_sweep(tmp_path):
    res = run_app("-m", "hydra/launcher=submitit_local", "experiment=bandit_sim", "smoke=true",
                  "logger=disabled", "seed=0,1", f"hydra.sweep.dir={tmp_path}")
    assert res.returncode == 0, res.stderr[-3000:]
    jobs = sorted(d for d in tmp_path.iterdir() if d.is_dir() and (d / ".hydra").is_dir())
    assert len(jobs) == 2
    assert all(records_in(d) for d in jobs)


BAD_INPUT = {
    "gamma": (["drafters.arms=[[eagle_lr72,0]]"], "gamma"),
    "temperature": (["experiment.temperature=-0.5"], "temperature"),
    "top_p": (["experiment.temperature=1.0", "experiment.top_p=1.5"], "top_p"),
    "vocab": (["+drafters.drafters.tiny={_target_: flashspec.drafters.ModelDrafter.separate, "
               "_partial_: true, source: 'dummy:tinyllama-1.1b'}"], "vocabulary"),
    "context": (["dataset.max_new_tokens=9000"], "context window"),
    "missing_model": (["target.source=/nonexistent/model.gguf"], "not found"),
    "batch": (["experiment.batch_size=0"], "batch_size"),
    "batch_text": (["experiment.batch_size=abc"], "experiment.batch_size must be an integer >= 1, got 'abc'"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_one_clear_line(case, tmp_path):
    overrides, needle = BAD_INPUT[case]
    res = run_app("experiment=decode", "logger=disabled", "experiment.warmup=false",
                  "dataset.n_prompts=1", f"hydra.run.dir={tmp_path}", *overrides)
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and needle in last, res.stderr[-2000:]
    assert not records_in(tmp_path)


@pytest.mark.slow
def test_corrupt_model_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    res = run_app("experiment=decode", "logger=disabled", f"target.source={bad}",
                  f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "corrupt" in last, res.stderr[-2000:]


def test_unknown_config_choice_names_the_options():
    res = run_app("bandit=nope", timeout=120)
    assert res.returncode != 0
    assert "bandit/nope" in res.stderr and "ucb1" in res.stderr
