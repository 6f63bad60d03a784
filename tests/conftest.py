"""Test-wide settings: Triton kernels run under the interpreter on the CPU (set before import)."""
import os

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
