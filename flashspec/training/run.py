"""One training job from plain options: data (cached), training, checkpoints, records.

Shared by ``experiments/train_drafter.py`` (Hydra) and the plain CLI (``python -m
experiments.train_drafter`` / ``python -m flashspec.training``), which needs neither Hydra nor
W&B.
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from flashspec.errors import FlashSpecError
from flashspec.models.llama import LlamaLM
from flashspec.drafters.eagle_checkpoint import save_eagle
from flashspec.training.data import DataSpec, load_mix
from flashspec.training.train import TrainConfig, eval_prompts, train

log = logging.getLogger(__name__)
MIN_TRAIN_S = 20.0
SAVE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclasses.dataclass
class JobOptions:
    """Everything a training job needs besides the target, the head and the logger."""

    data: list[DataSpec]            # mixture parts, concatenated
    train: TrainConfig
    out_dir: Path
    cache_dir: Path
    source: str = "smollm2"
    save_dtype: str = "float16"
    export: str | None = None       # copy the best checkpoint (+ .json) here
    train_head: bool = False
    progress: bool = True
    save_data: bool = True          # write generated data to the cache
    deadline: float | None = None   # unix time by which training (not the final eval) ends


def _fields(cls, mapping: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(mapping) - names
    if unknown:
        raise FlashSpecError(f"unknown {cls.__name__} key(s) {sorted(unknown)}; known: {sorted(names)}")
    return dict(mapping)


def data_spec(mapping: Mapping[str, Any]) -> DataSpec:
    return DataSpec(**_fields(DataSpec, mapping))


def data_specs(base: Mapping[str, Any], mix: list[Mapping[str, Any]] | None) -> list[DataSpec]:
    """One spec per mixture part: ``base`` updated by each entry of ``mix`` (None: base only)."""
    return [data_spec({**base, **dict(part)}) for part in (mix or [{}])]


def train_config(mapping: Mapping[str, Any]) -> TrainConfig:
    return TrainConfig(**_fields(TrainConfig, mapping))


def prepare_head(head: nn.Module | None, trainable: bool) -> nn.Module | None:
    """Freeze a configured head unless it is trained with the drafter."""
    if head is None:
        if trainable:
            raise FlashSpecError("train_head=true needs a low-rank head (head=lowrank); the full "
                                 "head is the target's own and stays frozen")
        return None
    head.requires_grad_(trainable)
    return head


def run_job(target: LlamaLM, tokenizer, opts: JobOptions, head: nn.Module | None = None,
            logger: Any = None, provenance: dict[str, Any] | None = None) -> dict[str, Any]:
    """Generate/load data, train, write eagle_best / eagle_last checkpoints and records."""
    from flashspec.records import RecordWriter
    if opts.save_dtype not in SAVE_DTYPES:
        raise FlashSpecError(f"save_dtype={opts.save_dtype!r}; choose one of {sorted(SAVE_DTYPES)}")
    out = Path(opts.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    head = prepare_head(head, opts.train_head)
    data = load_mix(target, tokenizer, opts.data, Path(opts.cache_dir), opts.source, opts.progress,
                    opts.save_data)
    if opts.deadline is not None:
        budget = max(MIN_TRAIN_S, opts.deadline - time.time())
        log.info("data ready; training budget %.0fs (deadline)", budget)
        opts = dataclasses.replace(opts, train=dataclasses.replace(opts.train, time_budget_s=budget))
    evalset = eval_prompts(tokenizer, opts.train.eval_prompts)
    eos = [int(tokenizer.eos_token_id)] if tokenizer.eos_token_id is not None else []
    writer = RecordWriter(out / "train_records.jsonl")
    prov = dict(provenance or {})
    prov.update(data={"key": data.meta.get("key"), "spec": data.meta.get("spec"),
                      "target": data.meta.get("target"), "n_sequences": len(data),
                      "n_tokens": data.n_tokens, "n_response_tokens": data.n_response_tokens,
                      "train_prompt_ids": data.meta.get("prompt_ids"),
                      "synthetic_prompts": data.meta.get("synthetic") or None,
                      "generation": [part.get("generation") for part in
                                     data.meta.get("parts", [data.meta])]},
                eval_prompt_ids=evalset.ids, train=dataclasses.asdict(opts.train))
    save_dt = SAVE_DTYPES[opts.save_dtype]
    saved_head = head if opts.train_head else None
    best_path = out / "eagle_best.safetensors"

    def log_fn(rec: dict[str, Any], step: int) -> None:
        if logger is not None:
            logger.log(rec, step=step)
        if any(k.startswith(("eval/", "val/")) for k in rec):
            writer.write({"experiment": "train_drafter", **rec, "provenance": prov})

    def on_best(module, head_now, rec: dict[str, Any]) -> None:
        meta = {**prov, "steps": rec["step"], "selected_by": "eval/tau_mean",
                "eval": {k: v for k, v in rec.items() if k.startswith(("eval/", "val/"))}}
        save_eagle(best_path, module, target, saved_head, meta, save_dt)

    result = train(target, data, opts.train, head, evalset, eos, log_fn, on_best, opts.progress)
    last_meta = {**prov, "steps": result.steps, "history": result.history}
    last = save_eagle(out / "eagle_last.safetensors", result.module, target, saved_head,
                      last_meta, save_dt)
    best = best_path if best_path.is_file() else last
    if opts.export:
        export = Path(opts.export)
        export.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(best, export)
        shutil.copyfile(best.with_suffix(".json"), export.with_suffix(".json"))
    summary = {"steps": result.steps, "best_step": result.best_step, "best_tau": result.best_tau,
               "final": result.history[-1] if result.history else {}, "train_wall_s": result.wall_s,
               "checkpoint": str(best), "last": str(last), "data_key": data.meta.get("key"),
               "n_tokens": data.n_tokens, "n_response_tokens": data.n_response_tokens}
    writer.write({"experiment": "train_drafter", "kind": "summary", **summary, "provenance": prov})
    if logger is not None:
        logger.summary({k: v for k, v in summary.items() if isinstance(v, (int, float))})
    return summary
