"""Experiment runners: experiments/<name>.py exposes ``run(cfg) -> dict``."""
from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

from flashspec.errors import FlashSpecError

if TYPE_CHECKING:  # the GPU machine runs plain `python -m experiments.<name>` without omegaconf
    from omegaconf import DictConfig


def run_experiment(cfg: "DictConfig") -> dict:
    """Import experiments.<cfg.experiment.name> and run it; bad input exits 2 with one line."""
    name = cfg.experiment.name
    try:
        module = importlib.import_module(f"experiments.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"experiments.{name}":
            raise FlashSpecError(f"no runner experiments/{name}.py for experiment={name}") from e
        raise
    try:
        return module.run(cfg)
    except FlashSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
