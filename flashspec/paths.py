"""Where things live: the repository root and repository-relative paths in configs."""
from __future__ import annotations

import os
from pathlib import Path


def repo_root() -> Path:
    """The repository (or source tree) holding the ``flashspec`` package."""
    return Path(__file__).resolve().parents[1]


def repo_path(value: str | Path) -> Path:
    """A path from a config: as given when absolute or existing, else relative to the repository
    (so ``checkpoints/x.safetensors`` works from any working directory)."""
    path = Path(str(value)).expanduser()
    if path.is_absolute() or path.exists():
        return path
    return repo_root() / path


def cache_root() -> Path:
    """Where converted models and per-machine measurements live: ``$FLASHSPEC_CACHE`` (a
    documented cache location) or ``<repo>/.cache/models``."""
    env = os.environ.get("FLASHSPEC_CACHE")
    return Path(env) if env else repo_root() / ".cache" / "models"
