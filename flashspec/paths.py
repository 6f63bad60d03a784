"""Where things live: the repository root and repository-relative paths in configs."""
from __future__ import annotations

import hashlib
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


def file_sha256(path: str | Path) -> str:
    """sha256 (hex) of a file's bytes, read in 1 MiB blocks: what caches and records key
    content by (prompt files, GGUF models, drafter checkpoints)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def temp_sibling(path: Path) -> Path:
    """A per-process temporary name next to ``path``: write there, then ``os.replace`` it onto
    ``path``, so concurrent writers (parallel sweep jobs, test workers) never share a half-written
    file and readers see the old file or the new one."""
    return path.with_name(f"{path.name}.tmp{os.getpid()}")


def write_text_atomic(path: Path, text: str) -> None:
    """``path.write_text(text)`` through :func:`temp_sibling` and ``os.replace``."""
    tmp = temp_sibling(path)
    tmp.write_text(text)
    os.replace(tmp, path)
