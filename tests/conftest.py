"""Test-wide settings: Triton kernels run under the interpreter on the CPU (set before import)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest  # noqa: E402


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
