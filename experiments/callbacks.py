"""Hydra callbacks (``hydra.callbacks`` in conf/config.yaml).

:class:`JobProgress` logs, for each job of a multirun, ``job i/N`` with the job's overrides when
it starts, and its own wall time and the sweep's elapsed time when it ends (into the console and
the job's run.log). N is the number of jobs Hydra's basic sweeper makes of the command line
(choice, range and glob sweeps); for another sweeper it is left out.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("flashspec.sweep")
CONF = Path(__file__).resolve().parents[1] / "conf"


class _GroupOptions:
    """What Hydra's glob sweep (``experiment=glob(*)``) asks a config loader: a group's options."""

    def get_group_options(self, group: str, results_filter: Any = None) -> list[str]:
        return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def count_jobs(config: DictConfig) -> int | None:
    """How many jobs Hydra's basic sweeper makes of this multirun's overrides (the product of
    the sweeps' lengths), or None when another sweeper runs it or a sweep cannot be counted."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    try:
        if not str(config.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper"):
            return None
        params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
        n = 1
        for override in OverridesParser.create().parse_overrides(
                params + list(config.hydra.overrides.task)):
            if not override.is_sweep_override():
                continue
            if not override.is_discrete_sweep():
                return None
            override.config_loader = _GroupOptions()   # only read by glob sweeps
            n *= len(list(override.sweep_string_iterator()))
        return n
    except Exception:   # a progress line is not worth failing a sweep over
        return None


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m{rest % 60:02d}s" if h else f"{rest // 60}m{rest % 60:02d}s"


class JobProgress(Callback):
    """``job i/N`` per job of a multirun, with the job's and the sweep's elapsed wall time."""

    def __init__(self) -> None:
        self.total: int | None = None
        self.sweep_start: float | None = None
        self.job_start: float | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.sweep_start = time.time()
        self.total = count_jobs(config)

    def _multirun(self, config: DictConfig) -> bool:
        return str(config.hydra.mode).endswith("MULTIRUN")   # RunMode.MULTIRUN

    def _label(self, config: DictConfig) -> str:
        i = int(config.hydra.job.num) + 1
        return f"job {i}/{self.total}" if self.total else f"job {i}"

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not self._multirun(config):
            return
        if self.sweep_start is None:   # a launcher that runs jobs in other processes (submitit)
            sweep = Path(config.hydra.sweep.dir) / "multirun.yaml"
            if sweep.is_file():
                self.sweep_start = sweep.stat().st_mtime
                self.total = count_jobs(OmegaConf.load(sweep))
        self.job_start = time.time()
        elapsed = f", sweep {_duration(self.job_start - self.sweep_start)} so far" \
            if self.sweep_start else ""
        log.info("%s (%s) starts%s", self._label(config),
                 config.hydra.job.override_dirname or "no overrides", elapsed)

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        if not self._multirun(config) or self.job_start is None:
            return
        now = time.time()
        status = getattr(getattr(job_return, "status", None), "name", "COMPLETED").lower()
        elapsed = f", sweep {_duration(now - self.sweep_start)} so far" if self.sweep_start else ""
        log.info("%s %s in %s%s", self._label(config), status, _duration(now - self.job_start), elapsed)
