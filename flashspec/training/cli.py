"""Plain command line for a drafter training job (no Hydra; W&B only when asked for).

    python -m experiments.train_drafter --device cuda --out runs/eagle --steps 20000 \
        --batch-tokens 65536 --set data.samples='{"humaneval": 8, "gsm8k": 4, "mtbench": 16}'
"""
from __future__ import annotations

import argparse
import ast
import logging
import sys
from pathlib import Path
from typing import Any, Sequence

from flashspec.errors import FlashSpecError

SMOKE_DATA = {"datasets": {"humaneval": 1, "gsm8k": 1, "mtbench": 1},
              "samples": {"humaneval": 1, "gsm8k": 1, "mtbench": 1}, "max_new_tokens": 8,
              "batch_size": 4}
GREEDY_PART = {"temperature": 0.0, "samples": {"humaneval": 1, "gsm8k": 1, "mtbench": 1}}
DEFAULT_MIX = [{}, GREEDY_PART]  # T=1 samples (the base spec) + the target's greedy continuations
SMOKE_TRAIN = {"steps": 3, "eval_every": 0, "eval_prompts": 1, "eval_new_tokens": 8,
               "batch_tokens": 512, "max_len": 256, "warmup": 1, "val_fraction": 0.34,
               "log_every": 1, "time_budget_s": None}


def parse_value(text: str) -> Any:
    """A Python/JSON literal when it parses (3, 0.5, true, null, {..}), else the string."""
    fixed = {"true": "True", "false": "False", "null": "None"}.get(text, text)
    try:
        return ast.literal_eval(fixed)
    except (ValueError, SyntaxError):
        return text


def apply_sets(sections: dict[str, dict[str, Any]], sets: Sequence[str]) -> None:
    """``section.key=value`` overrides (sections: data, train, job)."""
    for item in sets:
        key, sep, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or section not in sections:
            raise FlashSpecError(f"--set {item!r}: use data.<key>=v, train.<key>=v or job.<key>=v")
        sections[section][name] = parse_value(value)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train an EAGLE-style drafter for a Llama-family target.")
    p.add_argument("--out", required=True, help="run directory (checkpoints, records)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default=None, help="target dtype (default float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--source", default="smollm2", help="target: smollm2 | HF dir/id | .gguf")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-tokens", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--unroll", type=int, default=None)
    p.add_argument("--n-layers", type=int, default=None)
    p.add_argument("--time-budget", type=float, default=None, help="training seconds")
    p.add_argument("--gen-batch", type=int, default=None, help="generation batch size")
    p.add_argument("--mix", type=parse_value, default=None,
                   help="data mixture: list of overrides of the base data spec, e.g. "
                        "'[{}, {\"temperature\": 0.0, \"samples\": {\"gsm8k\": 1}}]'")
    p.add_argument("--head-rank", type=int, default=None,
                   help="train a low-rank head of this rank with the drafter (SVD init)")
    p.add_argument("--cache-dir", default=None, help="distill data cache (default .cache/eagle_data)")
    p.add_argument("--export", default=None, help="copy the best checkpoint here")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wandb", default="disabled", choices=["disabled", "offline", "online"])
    p.add_argument("--smoke", action="store_true", help="a few steps on tiny data")
    p.add_argument("--deadline", type=float, default=None,
                   help="unix time by which training ends: the budget left once the data is ready")
    p.add_argument("--no-save-data", action="store_true",
                   help="do not write generated data to the cache (a one-shot data+train job)")
    p.add_argument("--data-only", action="store_true",
                   help="generate (or load) the cached data and exit without training")
    p.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE",
                   help="any DataSpec (data.*), TrainConfig (train.*) or JobOptions (job.*) field")
    return p


def options_from_args(args: argparse.Namespace):
    from flashspec.paths import repo_root
    from flashspec.training.run import JobOptions, data_specs, train_config
    data: dict[str, Any] = {"seed": args.seed}
    tr: dict[str, Any] = {"seed": args.seed, **(SMOKE_TRAIN if args.smoke else {})}
    for key, value in (("steps", args.steps), ("batch_tokens", args.batch_tokens), ("lr", args.lr),
                       ("unroll", args.unroll), ("n_layers", args.n_layers),
                       ("time_budget_s", args.time_budget)):
        if value is not None:
            tr[key] = value
    if args.gen_batch is not None:
        data["batch_size"] = args.gen_batch
    job: dict[str, Any] = {"train_head": True} if args.head_rank else {}
    job.update({"deadline": args.deadline, "save_data": not args.no_save_data})
    apply_sets({"data": data, "train": tr, "job": job}, args.set)
    out = Path(args.out)
    cache = Path(args.cache_dir) if args.cache_dir else (
        out / "eagle_data" if args.smoke else repo_root() / ".cache" / "eagle_data")
    mix = [{**part, **(SMOKE_DATA if args.smoke else {})}
           for part in (DEFAULT_MIX if args.mix is None else args.mix)]
    return JobOptions(data=data_specs(data, mix), train=train_config(tr), out_dir=out, cache_dir=cache,
                      source=args.source, export=args.export, **job)


def build_data(target, tokenizer, opts) -> int:
    """``--data-only``: fill the data cache for ``opts`` and print what it holds."""
    from flashspec.training.data import load_mix
    data = load_mix(target, tokenizer, opts.data, opts.cache_dir, opts.source, opts.progress)
    print({"n_sequences": len(data), "n_tokens": data.n_tokens,
           "n_response_tokens": data.n_response_tokens, "key": data.meta.get("key"),
           "generation": [p.get("generation") for p in data.meta.get("parts", [data.meta])],
           "synthetic": {k: {"kept": v.get("kept"), "rejected": v.get("rejected")}
                         for k, v in (data.meta.get("synthetic") or {}).items()}})
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    import torch
    from flashspec.models import load_model
    from flashspec.records import NullLogger, WandbLogger, provenance
    from flashspec.training.run import run_job
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parser().parse_args(argv)
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        opts = options_from_args(args)
        dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
        target, tokenizer = load_model(args.source, dtype=dtype, device=args.device)
        config = {"cli": vars(args), "dtype": dtype}
        if args.data_only:
            return build_data(target, tokenizer, opts)
        logger = NullLogger() if args.wandb == "disabled" else WandbLogger(
            mode=args.wandb, project="flashspec", name="train_drafter", config=config,
            dir=opts.out_dir)
        head = None
        if args.head_rank:
            from flashspec.heads import LowRankChoice
            head = LowRankChoice(rank=args.head_rank, init="svd").build(
                target.lm_head_weight, None, "train_drafter").float()
        summary = run_job(target, tokenizer, opts, head, logger, provenance(config, args.seed))
        logger.finish()
    except FlashSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print({k: summary[k] for k in ("steps", "best_step", "best_tau", "checkpoint")})
    return 0
