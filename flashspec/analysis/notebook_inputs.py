"""What the notebooks read, from their environment variables, and the one line each stops with
when that input is missing or empty.

Every notebook takes its input from one environment variable (or its committed default; a
relative path is taken from the repository root). ``FLASHSPEC_SWEEP`` names a decode sweep (a
Hydra multirun of ``experiment=decode``): ``paper_tables`` and ``decode_results`` read it, the
notebooks of other experiments say in one line that it does not apply to them. A missing or
empty input raises :class:`NotebookInputError`, whose message names the variable and the path;
Jupyter and nbclient show that line instead of a traceback through pathlib and pandas.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

SWEEP_ENV = "FLASHSPEC_SWEEP"
SWEEP_COMMAND = "python run.py -m bandit=ucb1,thompson head.rank=d/8,d/16"


class NotebookInputError(FileNotFoundError):
    """A notebook's input is missing or holds nothing the notebook reads; the message says which
    variable, which path and what to run."""

    def _render_traceback_(self) -> list[str]:
        # IPython's hook: the lines it shows for this exception instead of the whole traceback
        # (the frames say nothing the message does not)
        return [f"{type(self).__name__}: {self}"]


def repo_root(start: Path | None = None) -> Path:
    """The FlashSpec checkout holding ``start`` (default: the working directory, the notebook's
    folder under Jupyter and nbclient)."""
    start = Path.cwd() if start is None else start
    for d in [start, *start.parents]:
        if (d / "pyproject.toml").is_file() and (d / "flashspec").is_dir():
            return d
    raise NotebookInputError(f"{start} is not inside a FlashSpec checkout: run the notebook from notebooks/")


def _named(env: str, value: str | None, path: Path) -> str:
    """How an error names the input: ``ENV=value`` as set (with the path it resolves to where
    that differs), or the default an unset ENV stands for."""
    if value is None:
        return f"{env} unset, its default {path}"
    return f"{env}={value}" + ("" if Path(value).expanduser() == path else f" ({path})")


def input_path(env: str, default: str | Path | None, root: Path) -> Path | None:
    """The path in environment variable ``env``, else ``default`` (None: no default, and None
    is returned); a relative path is taken from ``root``. Set but empty is an error: it usually
    means a shell variable that was never set (``FLASHSPEC_SWEEP=$SWEEP``)."""
    value = os.environ.get(env)
    if value is not None and not value.strip():
        raise NotebookInputError(f"{env} is set but empty: name a folder, or unset it for "
                                 f"{'the default ' + str(default) if default else 'none'}")
    if value is None and default is None:
        return None
    path = Path(value if value is not None else default).expanduser()
    return path if path.is_absolute() else root / path


def require(path: Path, env: str, patterns: Sequence[str], how: str) -> list[Path]:
    """The files matching any of ``patterns`` under folder ``path`` (or ``path`` itself, a file
    whose name matches), outside dot folders and wandb/; stops with one line naming ``env`` and
    ``path`` when the path does not exist or nothing there matches. ``how``: what to run or set."""
    value = os.environ.get(env)
    if not path.exists():
        raise NotebookInputError(f"{_named(env, value, path)}: does not exist; {how}")
    if path.is_file():
        found = [path] if any(path.match(p) for p in patterns) else []
    else:
        found = sorted({f for p in patterns for f in path.rglob(p) if f.is_file()
                        and not any(q.startswith(".") or q == "wandb" for q in f.relative_to(path).parts[:-1])})
    if not found:
        raise NotebookInputError(f"{_named(env, value, path)}: holds no {' or '.join(patterns)} "
                                 f"(empty, or not what this notebook reads); {how}")
    return found


def sweep_dir(root: Path, default: str | Path | None = None,
              needs: Sequence[str] = ("job_metrics.json",)) -> Path | None:
    """The decode sweep named by ``FLASHSPEC_SWEEP`` (else ``default``; None when neither is
    given), checked to hold ``needs`` (a finished job writes ``job_metrics.json``)."""
    path = input_path(SWEEP_ENV, default, root)
    if path is not None:
        require(path, SWEEP_ENV, needs, f"point {SWEEP_ENV} at the folder of a decode sweep, "
                f"e.g. `{SWEEP_COMMAND} hydra.sweep.dir=<folder>`")
    return path


def sweep_does_not_apply(root: Path, reads: str, instead: str) -> None:
    """For a notebook of another experiment: a set ``FLASHSPEC_SWEEP`` is checked like everywhere
    (a missing or empty sweep stops every notebook) and one line says why it is not read here
    (``reads``: what the notebook draws; ``instead``: where the sweep's counterpart is)."""
    path = sweep_dir(root)
    if path is not None:
        print(f"{SWEEP_ENV}={path} is not read here: this notebook draws {reads}; {instead}")


def jsonl_rows(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file (:func:`flashspec.records.read_records`), each with its run's
    ``provenance``: a committed benchmark file trimmed for size keeps it on its first row only,
    and the rows after it share it."""
    from flashspec.records import read_records
    rows, provenance = [], None
    for row in read_records(path):
        provenance = row["provenance"] = row.get("provenance") or provenance
        rows.append(row)
    return rows
