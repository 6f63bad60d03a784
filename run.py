"""FlashSpec entry point: `python run.py [group=choice ...] [-m for sweeps]`."""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from flashspec.config import register_resolvers

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> object:
    """Dispatch to experiments/<cfg.experiment.name>.py:run(cfg)."""
    from experiments import run_experiment
    return run_experiment(cfg)


if __name__ == "__main__":
    main()
