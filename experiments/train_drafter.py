"""experiment=train_drafter: self-distil an EAGLE-style drafter from the target's own generations.

Data (cached under .cache/eagle_data): the target samples (T ≈ 1) continuations of the `train`
split prompts of HumanEval, GSM8K and MT-Bench through SpecEngine; training fits the drafter to
the target's features and next-token distributions (KL + feature regression, unrolled on its own
predictions); greedy τ (γ=4) on held-out `eval` prompts picks the best checkpoint
(``eagle_best.safetensors`` + ``.json`` provenance in the run dir; ``experiment.export`` copies it).

Regenerate the committed checkpoint (CPU, ~25 min training once the data is cached):

    python run.py experiment=train_drafter logger=wandb_offline \
        experiment.export=checkpoints/smollm2_eagle.safetensors

Twins (one drafter per head, the same data, settings and seed: ρ_τ compares like with like),
resumable in short calls (rerun the same line until ``twins.json`` says finished):

    python run.py experiment=train_drafter 'experiment.heads=[full,d/8,d/16,d/32]' \
        experiment.resume=true experiment.call_budget_s=480 output_dir=outputs/twins_smollm2

The drafter trained for sampling (T = 1 data, three unrolled passes, the acceptance objective):
``experiment=train_drafter_sampled`` (conf/experiment/train_drafter_sampled.yaml).
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any


# smoke=true: a few tokens of data and three steps
SMOKE_DATA = {"datasets": {"humaneval": 1, "gsm8k": 1, "mtbench": 1},
              "samples": {"humaneval": 1, "gsm8k": 1, "mtbench": 1}, "max_new_tokens": 8,
              "batch_size": 4}
SMOKE_TRAIN = {"steps": 3, "eval_every": 0, "eval_prompts": 1, "eval_new_tokens": 8,
               "batch_tokens": 512, "max_len": 256, "warmup": 1, "val_fraction": 0.34,
               "log_every": 1, "time_budget_s": None}


# per-invocation keys: a run continued by a series of calls may change them between calls
CALL_KEYS = ("resume", "call_budget_s", "call_steps", "data_only")


def run(cfg) -> dict[str, Any]:
    """Hydra entry: target/hardware/head/logger from their groups, knobs from cfg.experiment.

    ``experiment.heads=[full, d/8, ...]`` trains a twin group (:func:`run_twins`) instead of one
    drafter with the ``head`` group's choice."""
    started = time.time()   # experiment.call_budget_s counts from here: loading and data included
    import torch
    from omegaconf import OmegaConf, open_dict
    from experiments.harness import build, load_target, run_dir
    from flashspec.heads import LowRankChoice
    from flashspec.paths import repo_path
    from flashspec.training.run import (JobOptions, data_specs, load_data, run_job, run_twins,
                                        train_config)

    exp = OmegaConf.to_container(cfg.experiment, resolve=True)
    if exp.get("threads"):
        torch.set_num_threads(int(exp["threads"]))
    data = {"seed": int(cfg.seed), **exp["data"]}
    mix = [{**part, **(SMOKE_DATA if cfg.smoke else {})} for part in (exp.get("data_mix") or [{}])]
    tr = {"seed": int(cfg.seed), **exp["train"], **(SMOKE_TRAIN if cfg.smoke else {})}
    out = Path(cfg.output_dir)
    cache = out / "eagle_data" if cfg.smoke else repo_path(exp.get("cache_dir") or ".cache/eagle_data")
    heads = exp.get("heads")
    opts = JobOptions(data=data_specs(data, mix), train=train_config(tr), out_dir=out, cache_dir=cache,
                      source=str(cfg.target.source), save_dtype=exp.get("save_dtype", "float16"),
                      export=None if cfg.smoke else exp.get("export"),
                      train_head=bool(exp.get("train_head", False)),
                      resume=bool(exp.get("resume", False)),
                      save_every=int(exp.get("save_every") or 0),
                      call_budget_s=exp.get("call_budget_s"), call_steps=exp.get("call_steps"),
                      started_at=started)
    target, tokenizer = load_target(cfg)
    stored = cfg.copy()   # what the run directory is tied to: the run, not this call's limits
    with open_dict(stored):
        for key in CALL_KEYS:
            stored.experiment.pop(key, None)
    with run_dir(stored, "train_records.jsonl") as run:
        if exp.get("data_only"):
            d = load_data(target, tokenizer, opts)
            return {"data_key": d.meta.get("key"), "n_sequences": len(d), "n_tokens": d.n_tokens}
        if heads:
            return run_twins(target, tokenizer, opts, list(heads), run.logger, run.provenance)
        choice = build(cfg.head)
        if isinstance(choice, LowRankChoice) and choice.init == "trained":   # what it starts from
            choice = replace(choice, init="svd")
        head = choice.build(target.lm_head_weight, None, "train_drafter")
        return run_job(target, tokenizer, opts, head, run.logger, run.provenance)
