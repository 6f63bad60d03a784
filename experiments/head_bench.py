"""Head latency benchmark (SlimSpec ν): full vs low-rank vs equal-cost truncated heads.

``python run.py experiment=head_bench [hardware=h200] [smoke=true]``.
The measurement lives in :mod:`flashspec.analysis.head_bench`; this file maps configs onto it.
"""
from __future__ import annotations

from typing import Any

from flashspec.analysis.head_bench import BenchConfig, run_bench

KNOBS = ("batches", "rank_divs", "warmup", "min_rounds", "max_rounds", "budget_s",
         "min_sample_s", "flush_factor", "max_copies", "truncated_kept", "threads", "layout",
         "cuda_graphs", "triton")


def bench_config(cfg: Any) -> BenchConfig:
    """BenchConfig from the composed config: experiment knobs, hardware device/dtype, smoke."""
    exp, hw = cfg.experiment, cfg.hardware
    dtype = exp.get("dtype") or hw.get("dtype")
    if cfg.get("smoke"):
        smoke = BenchConfig.smoke(hw.device, dtype)
        smoke.layout = exp.get("layout") or smoke.layout
        smoke.cuda_graphs = bool(exp.get("cuda_graphs")) and hw.device.startswith("cuda")
        return smoke
    knobs = {k: exp[k] for k in KNOBS if exp.get(k) is not None}
    knobs = {k: list(v) if k in ("batches", "rank_divs") else v for k, v in knobs.items()}
    shapes = [tuple(int(x) for x in s) for s in exp.shapes]
    return BenchConfig(shapes=shapes, device=hw.device, dtype=dtype, seed=int(cfg.seed), **knobs)


def run(cfg: Any) -> dict:
    """Hydra entry: records + figure in cfg.output_dir, W&B through cfg.logger."""
    from experiments.harness import run_dir
    with run_dir(cfg, "head_bench.jsonl") as run:
        summary = run_bench(bench_config(cfg), cfg.output_dir, run.config, run.logger)
        run.logger.summary({"n_records": summary["n_records"]})
    return summary
