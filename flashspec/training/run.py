"""One training job from plain options: data (cached), training, checkpoints, records.

:func:`run_twins` trains one drafter per head choice from the same data, settings and seed
(a twin group, :mod:`flashspec.training.twins`), each in ``out_dir/<head tag>``. Every job is
resumable: with ``resume`` a call continues each drafter from its saved state
(``train_state.pt``) and skips the finished ones (``done.json``), and a call stops itself at
``call_budget_s`` / ``call_steps`` with the state saved, so a long recipe runs as a series of
identical short calls.

Its front door is ``python run.py experiment=train_drafter`` (``experiments/train_drafter.py``).
"""
from __future__ import annotations

import dataclasses
import json
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
from flashspec.paths import write_text_atomic
from flashspec.training.data import DataSpec, DistillData, load_mix, target_tag
from flashspec.training.train import Resumable, TrainConfig, eval_prompts, train
from flashspec.training.twins import FULL, head_tag, twin_key

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
    resume: bool = False            # continue from out_dir's saved state; skip finished drafters
    save_every: int = 0             # also save the state every this many steps (0: when pausing)
    call_budget_s: float | None = None  # this call pauses (state saved) after this long
    started_at: float | None = None  # unix time call_budget_s counts from (None: the job's start)
    call_steps: int | None = None   # this call pauses after training this many steps


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
    stop_at = call_stop(opts)
    data = load_data(target, tokenizer, opts)
    return train_one(target, tokenizer, data, opts, head, logger, provenance, stop_at)


def call_stop(opts: JobOptions) -> float | None:
    """Unix time this call pauses at: ``call_budget_s`` after ``started_at`` (the run's start
    in experiments/train_drafter.py, so loading the target and generating data count against a
    device call's limit), or after now when no start is given."""
    if not opts.call_budget_s:
        return None
    return (opts.started_at if opts.started_at is not None else time.time()) + opts.call_budget_s


def load_data(target: LlamaLM, tokenizer, opts: JobOptions) -> DistillData:
    return load_mix(target, tokenizer, opts.data, Path(opts.cache_dir), opts.source, opts.progress,
                    opts.save_data)


def build_head(label: Any, target: LlamaLM) -> nn.Module | None:
    """The head a twin starts from: None for ``full`` (the target's own, frozen), else a
    low-rank head of that rank (``d/8`` or an int) from the SVD of the target's head."""
    from flashspec.heads import LowRankChoice
    if str(label) == FULL:
        return None
    return LowRankChoice(rank=label, init="svd").build(target.lm_head_weight, None,
                                                       "train_drafter").float()


def run_twins(target: LlamaLM, tokenizer, opts: JobOptions, heads: list[Any], logger: Any = None,
              provenance: dict[str, Any] | None = None) -> dict[str, Any]:
    """One drafter per head of ``heads`` (``full``, ``d/8``, 72, ...) from one data set and the
    same training settings, seed and schedule, one after another in ``out_dir/<tag>``
    (:func:`head_tag`); ``export`` names each file with ``{head}`` (its tag). A call that
    reaches its budget stops after saving the drafter it is training; with ``resume`` the
    next call continues it."""
    tags = [head_tag(h, target.shape.hidden_size) for h in heads]
    if len(set(tags)) != len(tags):
        raise FlashSpecError(f"experiment.heads={list(heads)} names a head twice ({tags})")
    if opts.export and "{head}" not in opts.export:
        raise FlashSpecError(f"experiment.export={opts.export!r} with several heads needs a "
                             "'{head}' placeholder (e.g. checkpoints/smollm2_twin_{head}.safetensors)")
    if opts.deadline is not None or opts.train.time_budget_s is not None:
        # a time budget ends each twin's schedule after as many steps as its head allows: a
        # low-rank twin, cheaper a step, would train longer than its full-head reference
        raise FlashSpecError("a deadline or experiment.train.time_budget_s ties the schedule to "
                             "wall time; twins train by steps: set experiment.train.steps and "
                             "leave train.time_budget_s null (call_budget_s splits the run into "
                             "calls)")
    stop_at = call_stop(opts)
    data = load_data(target, tokenizer, opts)
    out = Path(opts.out_dir)
    summaries: dict[str, dict[str, Any]] = {}
    for i, (label, tag) in enumerate(zip(heads, tags)):
        if stop_at is not None and time.time() >= stop_at and summaries:
            break   # no time left to start (or continue) the next twin in this call
        log.info("twin %d/%d: head %s (%s) in %s", i + 1, len(heads), label, tag, out / tag)
        sub = dataclasses.replace(
            opts, out_dir=out / tag, train_head=tag != FULL,
            export=opts.export.format(head=tag) if opts.export else None)
        prov = {**(provenance or {}), "twin_heads": dict(zip(tags, map(str, heads)))}
        summaries[tag] = train_one(target, tokenizer, data, sub, build_head(label, target),
                                   _Prefixed(logger, tag, i * opts.train.steps), prov, stop_at)
        if summaries[tag].get("paused"):
            break
        log.info("twin %s done: %s", tag, summaries[tag].get("checkpoint"))
    state = {t: ("not started" if t not in summaries else
                 f"paused at step {summaries[t]['steps']}" if summaries[t].get("paused") else "done")
             for t in tags}
    finished = all(v == "done" for v in state.values())
    status = {t: {"state": state[t], **{k: summaries.get(t, {}).get(k)
                                        for k in ("steps", "twin_key", "checkpoint")}}
              for t in tags}
    write_text_atomic(out / "twins.json", json.dumps({"finished": finished, "heads": status},
                                                      indent=1) + "\n")
    log.info("twins %s: %s", "finished" if finished else "paused (rerun with resume to go on)",
             state)
    return {"finished": finished, "heads": summaries}


class _Prefixed:
    """A logger whose keys carry the twin's tag and whose steps follow the previous twins'."""

    def __init__(self, logger: Any, tag: str, offset: int) -> None:
        self.logger, self.tag, self.offset = logger, tag, offset

    def log(self, rec: dict[str, Any], step: int) -> None:
        if self.logger is not None:
            self.logger.log({f"{self.tag}/{k}": v for k, v in rec.items()}, step=step + self.offset)

    def summary(self, values: dict[str, Any]) -> None:
        if self.logger is not None:
            self.logger.summary({f"{self.tag}/{k}": v for k, v in values.items()})


def train_one(target: LlamaLM, tokenizer, data: DistillData, opts: JobOptions,
              head: nn.Module | None, logger: Any = None, provenance: dict[str, Any] | None = None,
              stop_at: float | None = None) -> dict[str, Any]:
    """Train one drafter on ``data`` into ``opts.out_dir``: checkpoints, records, and (resumable)
    its training state; returns its summary (``paused`` when the call stopped it early)."""
    from flashspec.records import RecordWriter
    if opts.save_dtype not in SAVE_DTYPES:
        raise FlashSpecError(f"save_dtype={opts.save_dtype!r}; choose one of {sorted(SAVE_DTYPES)}")
    out = Path(opts.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    head = prepare_head(head, opts.train_head)
    if opts.deadline is not None:
        budget = max(MIN_TRAIN_S, opts.deadline - time.time())
        log.info("data ready; training budget %.0fs (deadline)", budget)
        opts = dataclasses.replace(opts, train=dataclasses.replace(opts.train, time_budget_s=budget))
    key = twin_key(data, opts.train, opts.save_dtype)
    tag = head_tag(head.rank if head is not None and hasattr(head, "rank") else FULL,
                   target.shape.hidden_size)
    done_path, state_path = out / "done.json", out / "train_state.pt"
    if opts.resume and done_path.is_file():
        done = json.loads(done_path.read_text())
        if done.get("twin_key") == key and done.get("head") == tag:
            log.info("%s: finished already (%s); nothing to train", out, done["checkpoint"])
            _export(opts, Path(done["checkpoint"]))
            return done
    if not opts.resume:   # a fresh start: an earlier run's state must not be continued later
        for stale in (done_path, state_path):
            stale.unlink(missing_ok=True)
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
                eval_prompt_ids=evalset.ids, train=dataclasses.asdict(opts.train),
                twin={"key": key, "head": tag, "target": target_tag(target, opts.source),
                      "heads": sorted(prov.get("twin_heads", {tag: tag}))})
    prov.pop("twin_heads", None)
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

    stops = opts.resume or opts.save_every or stop_at is not None or opts.call_steps is not None
    resumable = Resumable(state_path, every=opts.save_every, stop_at=stop_at,
                          call_steps=opts.call_steps, resume=opts.resume,
                          fingerprint=f"{key}:{tag}") if stops else None
    result = train(target, data, opts.train, head, evalset, eos, log_fn, on_best, opts.progress,
                   resumable)
    if result.paused:
        summary = {"paused": True, "steps": result.steps, "of_steps": opts.train.steps,
                   "best_step": result.best_step, "best_tau": result.best_tau,
                   "twin_key": key, "head": tag, "state": str(state_path)}
        writer.write({"experiment": "train_drafter", "kind": "paused", **summary,
                      "provenance": prov})
        return summary
    last_meta = {**prov, "steps": result.steps, "history": result.history}
    last = save_eagle(out / "eagle_last.safetensors", result.module, target, saved_head,
                      last_meta, save_dt)
    best = best_path if best_path.is_file() else last
    _export(opts, best)
    summary = {"steps": result.steps, "best_step": result.best_step, "best_tau": result.best_tau,
               "final": result.history[-1] if result.history else {}, "train_wall_s": result.wall_s,
               "checkpoint": str(best), "last": str(last), "data_key": data.meta.get("key"),
               "n_tokens": data.n_tokens, "n_response_tokens": data.n_response_tokens,
               "twin_key": key, "head": tag}
    writer.write({"experiment": "train_drafter", "kind": "summary", **summary, "provenance": prov})
    if logger is not None:
        logger.summary({k: v for k, v in summary.items() if isinstance(v, (int, float))})
    if resumable is not None:
        write_text_atomic(done_path, json.dumps(summary, indent=1, default=str) + "\n")
        state_path.unlink(missing_ok=True)   # the optimiser state is not needed any more
    return summary


def _export(opts: JobOptions, best: Path) -> None:
    """Copy the chosen checkpoint (+ .json) to ``opts.export``."""
    if opts.export:
        export = Path(opts.export)
        export.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(best, export)
        shutil.copyfile(best.with_suffix(".json"), export.with_suffix(".json"))
