"""FlashSpec entry point: `python run.py [group=choice ...] [-m for sweeps]`."""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

from experiments.resolvers import register_resolvers

register_resolvers()   # before Hydra composes: conf/config.yaml's sweep subdir uses ${path_safe:...}


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> object:
    """Check the composed config, then run experiments/<cfg.experiment.name>.py."""
    from experiments import run_experiment
    return run_experiment(cfg)


if __name__ == "__main__":
    main()
