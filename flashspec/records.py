"""Run records: JSONL files flushed per record, provenance, and a thin W&B wrapper."""
from __future__ import annotations

import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

import torch

_PACKAGES = ("torch", "triton", "transformers", "hydra-core", "wandb", "flashspec")


def git_commit() -> str:
    """Current commit of the repository holding this package ('unknown' outside git)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def hardware() -> dict[str, Any]:
    """What the run executed on."""
    info: dict[str, Any] = {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                            "machine": platform.machine()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def versions() -> dict[str, str]:
    """Installed versions of the libraries that shape results."""
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def provenance(config: dict[str, Any] | None = None, seed: int | None = None) -> dict[str, Any]:
    """Provenance block carried by every record."""
    return {"commit": git_commit(), "hardware": hardware(), "versions": versions(),
            "seed": seed, "config": config}


class RecordWriter:
    """Append-only JSONL writer; each record is flushed and fsynced as it is written."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, default=_jsonable) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def done_keys(self, *fields: str) -> set[tuple]:
        """Keys (tuple of ``fields``) of complete records already on disk, for resuming."""
        return {tuple(r.get(k) for k in fields) for r in read_records(self.path)}


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a JSONL file; a truncated last line (crash mid-write) is skipped."""
    path = Path(path)
    if not path.exists():
        return
    with path.open() as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def _jsonable(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x)}")


class NullLogger:
    """The logger that does nothing (``logger=disabled``): runners log unconditionally."""

    def __init__(self, **_: Any) -> None:
        pass

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        pass

    def summary(self, data: dict[str, Any]) -> None:
        pass

    def table(self, key: str, rows: list[dict[str, Any]]) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger(NullLogger):
    """A W&B run (``mode``: offline by default, or online).

    ``group`` gathers the jobs of one sweep, ``job_type`` names the experiment; ``id`` with
    ``resume="allow"`` continues the same W&B run when a run directory is resumed."""

    def __init__(self, mode: str = "offline", project: str = "flashspec", name: str | None = None,
                 group: str | None = None, config: dict | None = None, tags: list | None = None,
                 entity: str | None = None, dir: str | Path | None = None,
                 job_type: str | None = None, id: str | None = None) -> None:
        import wandb
        self.run = wandb.init(mode=mode, project=project, name=name, group=group, entity=entity,
                              config=config, tags=list(tags or []), dir=str(dir) if dir else None,
                              job_type=job_type, id=id, resume="allow" if id else None,
                              reinit="finish_previous", settings=wandb.Settings(silent=True))

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        self.run.log(data, step=step)

    def summary(self, data: dict[str, Any]) -> None:
        self.run.summary.update(data)

    def table(self, key: str, rows: list[dict[str, Any]]) -> None:
        if rows:
            import wandb
            cols = list(rows[0])
            self.run.log({key: wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in rows])})

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
