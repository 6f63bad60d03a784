"""Every notebook in notebooks/ executes headless (nbclient, a fresh python3 kernel, CPU only)
from committed records and shows no error; notebooks with something specific to show are
checked for it too (CHECKS)."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Environment settings the notebooks read; cleared so that each reads its committed default.
NOTEBOOK_ENV = ("FLASHSPEC_RESULTS", "FLASHSPEC_SWEEP", "FLASHSPEC_BANDIT_RECORDS",
                "FLASHSPEC_HEAD_BENCH_DIR", "FLASHSPEC_KERNEL_BENCH")


def execute(path: Path, timeout: int = 300):
    """The notebook after running every cell in its own folder; raises on a failing cell."""
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def outputs(nb) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


def text(nb) -> str:
    """Printed text and plain-text results of every cell."""
    return "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in outputs(nb))


def images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for o in outputs(nb))


def check_bandit_regret(nb) -> None:
    assert images(nb) >= 1
    assert "bar met: True" in text(nb)


def check_head_bench(nb) -> None:
    assert images(nb) >= 1
    assert "bench records" in text(nb) and " 0 bench records" not in text(nb)
    assert "overlap: 0" in text(nb)   # the distillation table: train/eval prompts disjoint


def check_decode_results(nb) -> None:
    n = re.search(r"(\d+) decode records from \d+ run dir\(s\): (\S+)", text(nb))
    assert n and int(n.group(1)) > 0, text(nb)[:500]
    out = Path(n.group(2)).parent
    for name in ("results_tps.png", "results_tau.png", "results_speedup.png", "results_speedup.csv"):
        assert (out / name).is_file(), name
    assert images(nb) >= 3


def check_kernel_bench(nb) -> None:
    assert re.search(r"[1-9]\d* records from", text(nb))
    assert images(nb) >= 1


def check_paper_tables(nb) -> None:
    found = re.search(r"(\d+) jobs, (\d+) decode records from", text(nb))
    assert found and int(found.group(1)) > 0 and int(found.group(2)) > 0
    assert images(nb) >= 4   # TPS bars, regret on the stream, regret in simulation, ρ_TPS
    assert "simulated runs" in text(nb)


CHECKS: dict[str, Callable] = {
    "bandit_regret.ipynb": check_bandit_regret,
    "head_bench.ipynb": check_head_bench,
    "decode_results.ipynb": check_decode_results,
    "kernel_bench.ipynb": check_kernel_bench,
    "paper_tables.ipynb": check_paper_tables,
}


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks/*.ipynb found"
    assert {p.name for p in NOTEBOOKS} >= set(CHECKS), "a checked notebook went missing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_without_errors(path: Path, monkeypatch):
    for name in NOTEBOOK_ENV:
        monkeypatch.delenv(name, raising=False)
    # the kernel imports this checkout's flashspec/ and experiments/, whatever is installed
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = execute(path)
    errors = [o for o in outputs(nb) if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0].ename}: {errors[0].evalue}"
    stderr = "".join(o.get("text", "") for o in outputs(nb) if o.get("name") == "stderr")
    assert "Traceback" not in stderr, stderr[-2000:]
    CHECKS.get(path.name, lambda nb: None)(nb)
