"""Every notebook in notebooks/ executes headless (nbclient, a fresh python3 kernel, CPU only)
from committed records and shows no error; notebooks with something specific to show are
checked for it too (CHECKS). The decode-sweep notebooks also run on a fresh sweep of the design
card's shape, and every notebook stops with one line on a missing or empty sweep folder."""
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


def kernel_env(monkeypatch, **env: str) -> None:
    """The notebooks' environment: their settings cleared but ``env``; this checkout importable."""
    for name in NOTEBOOK_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # the kernel imports this checkout's flashspec/ and experiments/, whatever is installed
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


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
    # the distillation table (scripts/distill_head.py records, on lab-notebook since 5ffa3b8)
    # where the folder has them: train and eval prompts disjoint
    if " 0 distillation records" not in text(nb):
        assert "overlap: 0" in text(nb)


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


# Notebooks of other experiments: a decode sweep in FLASHSPEC_SWEEP is named and not read.
SWEEP_NOT_READ = ("bandit_regret", "head_bench", "kernel_bench")

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


def assert_clean(path: Path, nb) -> None:
    errors = [o for o in outputs(nb) if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0].ename}: {errors[0].evalue}"
    stderr = "".join(o.get("text", "") for o in outputs(nb) if o.get("name") == "stderr")
    assert "Traceback" not in stderr, stderr[-2000:]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_without_errors(path: Path, monkeypatch):
    """Notebooks of other experiments run with FLASHSPEC_SWEEP set (the committed sweep): they
    say in one line that a decode sweep does not apply to them, and draw their own records."""
    sweep = ROOT / "experiments" / "results" / "design_card_sweep"
    kernel_env(monkeypatch, **({"FLASHSPEC_SWEEP": str(sweep)} if path.stem in SWEEP_NOT_READ else {}))
    nb = execute(path)
    assert_clean(path, nb)
    CHECKS.get(path.name, lambda nb: None)(nb)
    if path.stem in SWEEP_NOT_READ:
        assert f"FLASHSPEC_SWEEP={sweep} is not read here: this notebook draws " in text(nb)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_missing_or_empty_sweep_stops_the_notebook_with_one_line(path: Path, tmp_path: Path, monkeypatch):
    """``FLASHSPEC_SWEEP`` naming a folder that is not there, or one without a finished job: the
    first cell stops with one line (the whole traceback) naming the variable and the folder."""
    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "missing", tmp_path / "empty"):
        kernel_env(monkeypatch, FLASHSPEC_SWEEP=str(folder))
        with pytest.raises(nbclient.exceptions.CellExecutionError) as stop:
            execute(path, timeout=120)
        assert stop.value.ename == "NotebookInputError", str(stop.value)[-2000:]
        line = stop.value.evalue
        assert f"FLASHSPEC_SWEEP={folder}:" in line and "\n" not in line, line
        assert ("does not exist" if folder.name == "missing" else "holds no ") in line, line
        # the whole traceback is that one line (no frames through pathlib, pandas or collect.py)
        assert str(stop.value).rstrip().splitlines()[-1] == f"NotebookInputError: {line}", str(stop.value)


# ----------------------------------------------------------------------------- a fresh sweep
# design_card_sweep (tests/conftest.py): the design card's sweep run small, once per session
# (test_decode_reuse.py checks which of its records the later jobs copied).


@pytest.mark.slow
def test_paper_tables_on_a_fresh_design_card_sweep(design_card_sweep: Path, monkeypatch):
    """Every job's regret/final is what the notebook recomputes from its records (the notebook's
    last check), with every arm of the default drafter set measured alone, the tree arm too."""
    kernel_env(monkeypatch, FLASHSPEC_SWEEP=str(design_card_sweep))
    path = ROOT / "notebooks" / "paper_tables.ipynb"
    nb = execute(path)
    assert_clean(path, nb)
    check_paper_tables(nb)
    assert "4 jobs, " in text(nb) and str(design_card_sweep) in text(nb)
    assert "regret/final of 4 job(s) recomputed from their records: equal" in text(nb)
    assert "eagle_lr72@dyn3d3k2" in text(nb) + "".join(o.get("data", {}).get("text/html", "") for o in outputs(nb))


@pytest.mark.slow
def test_decode_results_on_a_fresh_design_card_sweep(design_card_sweep: Path, monkeypatch):
    """With FLASHSPEC_SWEEP set and FLASHSPEC_RESULTS not, decode_results collects the sweep."""
    kernel_env(monkeypatch, FLASHSPEC_SWEEP=str(design_card_sweep))
    path = ROOT / "notebooks" / "decode_results.ipynb"
    nb = execute(path)
    assert_clean(path, nb)
    check_decode_results(nb)
    assert re.search(r"\d+ decode records from 4 run dir\(s\): \S+/decode_results/sweep/results.parquet", text(nb))


def test_the_notebook_names_a_jobs_arms_as_the_job_does():
    """paper_tables names a job's arms from its config (``experiments.harness.arm_names``), the
    job from the arms it built (``Arm.label``): the same names for a chain, a draft tree and the
    target-only arm, so each arm's records alone (``spec:<arm>``) are found for its μ_k."""
    from experiments.harness import arm_names, build_arms
    from flashspec.drafters.ngram import NgramDrafter
    cfg = {"drafters": {"ngram": {}}, "arms": [["ngram", 3], ["ngram", "3x1x1"], ["ar", 1]]}
    built = build_arms(cfg, {"ngram": NgramDrafter()})
    assert arm_names(cfg) == [a.label for a in built] == ["ngram@3", "ngram@3x1x1", "ar"]
