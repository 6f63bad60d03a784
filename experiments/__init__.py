"""Experiment runners: experiments/<name>.py exposes ``run(cfg) -> dict``."""
from __future__ import annotations

import importlib
import logging
import sys
from typing import TYPE_CHECKING

from flashspec.errors import FlashSpecError

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger("flashspec")


def run_experiment(cfg: "DictConfig") -> dict:
    """Validate the config (before any model loads), import experiments.<cfg.experiment.name>
    and run it; bad input exits 2 with one line naming the problem."""
    from hydra.core.hydra_config import HydraConfig

    from experiments.harness import validate
    name = cfg.experiment.name
    try:
        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
        validate(cfg, overrides)
        try:
            module = importlib.import_module(f"experiments.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"experiments.{name}":
                raise FlashSpecError(f"no runner experiments/{name}.py for experiment={name}") from e
            raise
        return module.run(cfg)
    except FlashSpecError as e:
        log.error("error: %s", e)   # into the job's run.log
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
