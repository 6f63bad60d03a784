"""Test-wide settings: Triton kernels run under the interpreter on the CPU (set before import);
helpers and fixtures several test files share."""
import os
import shutil
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"

from experiments.resolvers import register_resolvers  # noqa: E402

register_resolvers()   # the configs' own resolvers (${path_safe:...}, ${by_temperature:...}), as run.py


def job_config(*overrides: str):
    """The config a run.py job with ``overrides`` gets (Hydra's runtime config set, as the
    runners read it), its output_dir a placeholder."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        cfg.output_dir = "/tmp/unused"
        del cfg["hydra"]
    return cfg


def drive_as_on_a_gpu(monkeypatch) -> None:
    """Resident engines driven as on a GPU, where the device runs ahead of the host: each
    chunk's first drafting is queued before the host reads the chunk in flight (plain steps a
    whole chunk ahead). The eager CPU loop runs the same halves in that order; the reference
    stepper still reads each step before the next."""
    from flashspec import engine, stepper
    monkeypatch.setattr(engine, "run_chunks", lambda loop, *args, overlap: stepper.run_chunks(
        loop, *args, overlap=not isinstance(loop, stepper.ReferenceStepper)))


@pytest.fixture
def overlapped(monkeypatch):
    drive_as_on_a_gpu(monkeypatch)


# The design card's sweep (`python run.py -m bandit=ucb1,thompson head.rank=d/8,d/16`): four
# jobs over the default drafter set (five arms, the draft-tree arm among them), later jobs
# copying the records no swept setting touches. One prompt of 24 new tokens instead of eight of
# 128: enough verify steps that every policy plays every arm, the tree arm included.
SWEEP_OVERRIDES = ["bandit=ucb1,thompson", "head.rank=d/8,d/16", "dataset.n_prompts=1",
                   "dataset.max_new_tokens=24", "experiment.warmup=false", "experiment.timing_iters=2",
                   "logger=disabled"]


@pytest.fixture(scope="session")
def design_card_sweep(tmp_path_factory) -> Path:
    """The design card's sweep, run once per test session for the tests that read it
    (test_notebooks.py's notebooks on a fresh sweep, test_decode_reuse.py's reuse checks): under
    pytest-xdist the first worker to ask runs it into the session's shared temp folder, under a
    file lock, and any other worker reads it there. The run's stdout and stderr are in
    ``run.log`` beside the sweep folder."""
    from filelock import FileLock
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent           # the session's folder, above each worker's own
    out = root / "design_card" / "sweep"
    with FileLock(str(root / "design_card.lock")):
        if not (out.parent / "done").is_file():   # not yet run, or an earlier try failed
            shutil.rmtree(out, ignore_errors=True)
            out.parent.mkdir(exist_ok=True)
            env = {**os.environ, "TRITON_INTERPRET": "1", "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "0"}
            res = subprocess.run([sys.executable, "run.py", "-m", *SWEEP_OVERRIDES,
                                  f"hydra.sweep.dir={out}"], cwd=CONF.parent, env=env,
                                 capture_output=True, text=True, timeout=1200)
            (out.parent / "run.log").write_text(res.stdout + res.stderr)
            assert res.returncode == 0, res.stderr[-3000:]
            (out.parent / "done").touch()
    assert len(list(out.glob("*/job_metrics.json"))) == 4
    assert all('"reused_from"' in f.read_text() for f in out.glob("[123]_*/records.jsonl"))   # copies, as in a real sweep
    return out
