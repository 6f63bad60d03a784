"""Types and ranges of the config values the runners read, checked once right after
composition (``experiments.harness.validate``), before any model loads.

Hydra types a command-line value by its text: ``experiment.top_k=2.5`` arrives as a float,
``=true`` as a bool, ``=abc`` as a string. A runner that casts (``int(exp.top_k)``) would run
2.5 as 2 and ``true`` as 1 while the records keep what was typed, or die in a traceback on
``abc``. Every value a runner reads is declared here instead, with its type and range; a value
that does not fit is one line naming the key, what it must be and what it got. (The objects the
groups build check their own combinations of values; this module only makes sure each value is
of the kind the code reads it as.)

Keys are dotted paths; ``*`` stands for any one key of a mapping or item of a list. A key that
the composed config does not hold is skipped (groups differ in what they carry).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from omegaconf import DictConfig, ListConfig, OmegaConf

from flashspec.core import TreeShape
from flashspec.errors import FlashSpecError


@dataclass(frozen=True)
class Kind:
    """What a value must be: ``what`` reads after "must be" in the error."""

    what: str
    ok: Callable[[Any], bool]
    integral: bool = False   # an integer kind: a float of integral value is stored as the int

    def __or__(self, other: "Kind") -> "Kind":
        return Kind(f"{self.what} or {other.what}", lambda v: self.ok(v) or other.ok(v),
                    self.integral or other.integral)


def _real(v: Any) -> bool:
    """A finite real number; a bool is not one (``true`` would pass as 1)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _integral(v: Any) -> bool:
    """An int, or a float with an integral value (2.0 is read exactly as 2; 2.5 is refused)."""
    return _real(v) and float(v).is_integer()


def integer(lo: int | None = None) -> Kind:
    what = "an integer" + (f" >= {lo}" if lo is not None else "")
    return Kind(what, lambda v: _integral(v) and (lo is None or v >= lo), integral=True)


def number(lo: float | None = None, hi: float | None = None, lo_open: bool = False,
           hi_open: bool = False) -> Kind:
    """A finite number in the range; ``lo``/``hi`` None leave that side open."""
    if lo is not None and hi is not None:
        what = (f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}")
    elif lo is not None:
        what = f"a finite number {'>' if lo_open else '>='} {lo:g}"
    else:
        what = "a finite number"

    def ok(v: Any) -> bool:
        if not _real(v):
            return False
        if lo is not None and (v <= lo if lo_open else v < lo):
            return False
        return hi is None or (v < hi if hi_open else v <= hi)
    return Kind(what, ok)


def choice(*options: str) -> Kind:
    return Kind(f"one of {', '.join(options)}", lambda v: isinstance(v, str) and v in options)


def nested(kind: Kind) -> Kind:
    """``kind``, or lists and mappings of it at any depth (a scenario's means per phase or
    per domain)."""
    def ok(v: Any) -> bool:
        if isinstance(v, (list, ListConfig)):
            return len(v) > 0 and all(ok(x) for x in v)
        if isinstance(v, (Mapping, DictConfig)):
            return len(v) > 0 and all(ok(x) for x in v.values())
        return kind.ok(v)
    return Kind(f"{kind.what} (or lists of them)", ok)


BOOL = Kind("true or false", lambda v: isinstance(v, bool))
LIST = Kind("a list", lambda v: isinstance(v, (list, ListConfig)))
TEXT = Kind("a string", lambda v: isinstance(v, str))
NULL = Kind("null", lambda v: v is None)
TEXTS = Kind("a list of strings", lambda v: isinstance(v, (list, ListConfig))
             and all(isinstance(x, str) for x in v))
POSITIVE = integer(1)
COUNT = integer(0)
SECONDS = number(0, lo_open=True) | NULL


# ----------------------------------------------------------------------------- per group
# Sampling settings, shared by the runners that decode or generate.
SAMPLING = {"temperature": number(0), "top_k": COUNT, "top_p": number(0, 1, lo_open=True)}

# Keys of every policy group (conf/bandit/*.yaml); a contextual policy's ``inner`` takes the same.
BANDIT = {"reward": TEXT, "full_info": BOOL, "reward_scale": number(0, lo_open=True),
          "arm": COUNT, "c": number(0), "epsilon": number(0, 1), "window": POSITIVE,
          "discount": number(0, 1, lo_open=True), "prior_alpha": number(0, lo_open=True),
          "prior_beta": number(0, lo_open=True), "eta": number(0, lo_open=True) | NULL,
          "horizon": POSITIVE, "min_pulls": COUNT, "min_prompts": POSITIVE,
          "prior_weight": number(0, lo_open=True), "explore": number(0), "key": TEXT | TEXTS,
          "cold": BOOL}

COMMON: dict[str, Kind] = {
    "seed": COUNT,
    "smoke": BOOL,
    **{f"target.{k}": v for k, v in {
        "source": TEXT, "dtype": TEXT, "device": TEXT, "quantization": TEXT | NULL}.items()},
    **{f"dataset.{k}": v for k, v in {
        "name": TEXT, "n_prompts": POSITIVE | NULL, "max_new_tokens": POSITIVE,
        "split": choice("eval", "train"), "seed": COUNT, "source": choice("local", "hub"),
        "block_size": POSITIVE, "domains": TEXTS | NULL}.items()},
    **{f"hardware.{k}": v for k, v in {
        "name": TEXT, "device": TEXT, "dtype": TEXT, "quantization": TEXT | NULL,
        "mem_bandwidth_gbs": number(0, lo_open=True),
        "peak_tflops": number(0, lo_open=True)}.items()},
    **{f"runtime.{k}": v for k, v in {
        "name": TEXT, "verify_backend": TEXT, "cuda_graphs": BOOL,
        "resident_loop": BOOL, "resident_chunk": POSITIVE, "fused_layers": BOOL,
        "kernels.fuse_topk_on_cuda": BOOL, "kernels.fuse_merges": BOOL | NULL,
        "kernels.fuse_finish": BOOL, "kernels.direct_launch": BOOL,
        "kernels.head_triton": BOOL}.items()},
    **{f"head.{k}": v for k, v in {
        "rank": POSITIVE | TEXT | NULL, "init": TEXT, "checkpoint": TEXT | NULL,
        "layout": choice("out_in", "in_out"),
        "keep": POSITIVE | number(0, 1, lo_open=True) | TEXT, "frequencies": TEXT,
        "always_keep": LIST, "always_keep.*": COUNT}.items()},
    **{f"planner.{k}": v for k, v in {
        "objective": TEXT, "explore": COUNT, "decay": number(0, 1, lo_open=True),
        "smoothing": number(0, 1, lo_open=True), "prior": number(0), "replan": POSITIVE,
        "reprobe": POSITIVE}.items()},
    **{f"drafters.{k}": v for k, v in {
        "gammas": LIST, "gammas.*": POSITIVE, "arms": LIST | NULL,
        "drafters.*.max_ngram": POSITIVE, "drafters.*.min_ngram": POSITIVE,
        "drafters.*.first": POSITIVE, "drafters.*.checkpoint": TEXT | NULL,
        "drafters.*.twin": TEXT | NULL, "drafters.*.head_dtype": TEXT | NULL,
        "drafters.*.source": TEXT,
        "drafters.*.quantization": TEXT | NULL, "drafters.*.heads.*": TEXT,
        "drafters.*.draft_temperature": number(0)}.items()},
    **{f"{where}.{k}": v for where in ("bandit", "bandit.inner") for k, v in BANDIT.items()},
    **{f"priors.{k}": v for k, v in {
        "use": BOOL, "path": TEXT, "weight": number(0), "save": TEXT | NULL}.items()},
}

DECODE = {**SAMPLING, "methods": TEXTS, "references": TEXTS, "reuse": BOOL,
          "timing_iters": POSITIVE, "batch_size": POSITIVE, "hf_prompt_lookup_tokens": POSITIVE,
          "warmup": BOOL, "rotate_methods": BOOL, "records": TEXT, "max_turns": POSITIVE | NULL,
          "prefill_all": BOOL,
          **{f"{where}.{k}": v for where in ("extra_bandits.*", "extra_bandits.*.inner")
             for k, v in BANDIT.items()}}

# experiment=bench: the decode runner with named methods (experiments.harness.bench_method
# checks each entry's keys and builds its objects).
MAPPING = Kind("a mapping", lambda v: isinstance(v, (Mapping, DictConfig)))


def _tree_shape(value: Any) -> bool:
    try:
        TreeShape.parse(value)
    except (FlashSpecError, TypeError, ValueError):
        return False
    return isinstance(value, str)


TREE_SHAPE = Kind("a draft-tree shape ('4x2x1', 'dyn15d6k4')", _tree_shape)
BENCH = {**{k: v for k, v in DECODE.items() if k != "methods"}, "methods": MAPPING,
         "tree": TREE_SHAPE,
         "methods.*": MAPPING | NULL, "methods.*.arms": LIST,
         **{f"methods.*.{k}": TEXT | MAPPING | NULL for k in ("runtime", "bandit", "planner")}}

_HEAD = {k.removeprefix("head."): v for k, v in COMMON.items() if k.startswith("head.")}
HEAD_DECODE = {"drafter_name": TEXT, "gamma": POSITIVE, "temperature": number(0),
               "timing_iters": POSITIVE, "drafter.checkpoint": TEXT, "drafter.first": POSITIVE,
               "drafter.source": TEXT,
               "variants.*.drafter.checkpoint": TEXT, "variants.*.drafter.first": POSITIVE,
               **{f"variants.*.head.{k}": v for k, v in _HEAD.items()}}

BANDIT_SIM = {"horizon": POSITIVE, "n_seeds": POSITIVE, "n_points": POSITIVE, "records": TEXT,
              "figure": TEXT, "progress": BOOL, "default_policies": TEXTS,
              "smoke.horizon": POSITIVE, "smoke.n_seeds": POSITIVE, "smoke.n_points": POSITIVE,
              "scenarios.*.title": TEXT, "scenarios.*.rewards": choice("bernoulli", "beta"),
              "scenarios.*.concentration": number(0, lo_open=True),
              "scenarios.*.change_fractions.*": number(0, 1, lo_open=True, hi_open=True),
              "scenarios.*.policies": TEXTS, "scenarios.*.means": nested(number(0, 1)),
              "scenarios.*.domain_probs.*": number(0, 1), "paper.scenario": TEXT,
              "scenarios.*.chains.alphas.*": nested(number(0, 1)),
              "scenarios.*.chains.arms": TEXTS, "scenarios.*.chains.reward": choice("alpha", "tps"),
              "scenarios.*.chains.costs": nested(number(0, lo_open=True)),
              "paper.ucb1": number(0), "paper.thompson": number(0), "paper.bound": number(0),
              **{f"{where}.{k}": v for where in ("policies.*", "policies.*.inner")
                 for k, v in BANDIT.items()}}

HEAD_BENCH = {"shapes": LIST, "shapes.*": LIST, "shapes.*.*": POSITIVE, "batches": LIST,
              "batches.*": POSITIVE, "rank_divs": LIST, "rank_divs.*": POSITIVE,
              "dtype": TEXT | NULL, "warmup": COUNT, "min_rounds": POSITIVE,
              "max_rounds": POSITIVE, "budget_s": number(0, lo_open=True),
              "truncated_kept": BOOL, "threads": POSITIVE | NULL,
              "layout": choice("out_in", "in_out"), "cuda_graphs": BOOL, "triton": BOOL}

_KERNEL_SIZES = {"batches": LIST, "batches.*": POSITIVE, "gammas": LIST, "gammas.*": POSITIVE,
                 "vocabs": LIST, "vocabs.*": POSITIVE, "iters": POSITIVE, "ref_iters": POSITIVE,
                 "warmup": COUNT}
KERNEL_BENCH = {**_KERNEL_SIZES, **{f"smoke_shapes.{k}": v for k, v in _KERNEL_SIZES.items()},
                "shapes": LIST | NULL, "shapes.*": LIST, "shapes.*.*": POSITIVE, "dtype": TEXT, "draft": choice("full", "onehot"),
                "temperature": number(0), "graph_replays": POSITIVE, "l2_bytes": COUNT,
                "max_buffers": POSITIVE, "compile_ref": BOOL, "time_budget_s": SECONDS,
                "check_seeds": LIST, "check_seeds.*": COUNT, "precompile": COUNT}

_DATA = {**SAMPLING, "max_new_tokens": POSITIVE, "batch_size": POSITIVE, "split": choice(
         "eval", "train"), "topk": POSITIVE, "time_budget_s": SECONDS, "samples.*": POSITIVE,
         "datasets.*": POSITIVE | NULL}
TRAIN_DRAFTER = {
    "threads": POSITIVE | NULL, "cache_dir": TEXT, "export": TEXT | NULL, "train_head": BOOL,
    "save_dtype": choice("float16", "bfloat16", "float32"),
    "heads": LIST | NULL, "heads.*": TEXT | POSITIVE, "resume": BOOL, "save_every": COUNT,
    "call_budget_s": SECONDS, "call_steps": POSITIVE | NULL, "data_only": BOOL,
    **{f"data.{k}": v for k, v in _DATA.items()},
    **{f"data_mix.*.{k}": v for k, v in _DATA.items()},
    **{f"train.{k}": v for k, v in {
        "steps": POSITIVE, "lr": number(0, lo_open=True), "min_lr_ratio": number(0, 1),
        "warmup": COUNT, "weight_decay": number(0), "grad_clip": number(0, lo_open=True),
        "batch_tokens": POSITIVE, "max_len": POSITIVE, "unroll": POSITIVE,
        "unroll_from_step": COUNT, "unroll_decay": number(0, 1), "detach_unroll": BOOL,
        "w_kl": number(0), "w_accept": number(0), "w_reg": number(0), "kl_from_step": COUNT,
        "reg": choice("smooth_l1", "logit_mse"), "noise": number(0),
        "loss_on": choice("response", "all"), "amp": choice("bf16", "none"),
        "val_fraction": number(0, 1, hi_open=True), "eval_every": POSITIVE,
        "eval_prompts": COUNT, "eval_new_tokens": POSITIVE, "eval_gamma": POSITIVE,
        "eval_temperature": number(0), "log_every": POSITIVE, "time_budget_s": SECONDS, "n_layers": POSITIVE,
        "out_norm": BOOL, "in_norm": BOOL, "init": TEXT}.items()}}

# experiment.name -> its keys under ``experiment.``
EXPERIMENTS: dict[str, dict[str, Kind]] = {
    "decode": DECODE, "bench": BENCH, "head_decode": HEAD_DECODE, "bandit_sim": BANDIT_SIM,
    "head_bench": HEAD_BENCH, "kernel_bench": KERNEL_BENCH, "train_drafter": TRAIN_DRAFTER}


def schema(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Kind]:
    """Every declared key of this config: the groups' and its experiment's."""
    name = cfg.get("experiment", {}).get("name") if "experiment" in cfg else None
    own = EXPERIMENTS.get(str(name), {})
    return {**COMMON, "experiment.name": TEXT, **{f"experiment.{k}": v for k, v in own.items()}}


def check_config(cfg: DictConfig | Mapping[str, Any]) -> None:
    """Raise FlashSpecError, one line naming the key, for the first value of ``cfg`` that is not
    of its declared kind (e.g. ``experiment.top_k must be an integer >= 0, got 2.5``).

    An integer typed as an integral float (``experiment.top_k=2.0``) is stored back as the int,
    so that no runner meets a float where it counts (``range(2.0)``) and the stored config and
    the records say 2 (an interpolated value is left to the key it comes from)."""
    for pattern, kind in schema(cfg).items():
        for key, value, parent, name in values(cfg, pattern):
            if not kind.ok(value):
                raise FlashSpecError(f"{key} must be {kind.what}, got {value!r}")
            if kind.integral and isinstance(value, float) and not _interpolated(parent, name):
                parent[int(name) if isinstance(parent, (list, ListConfig)) else name] = int(value)


def _interpolated(parent: Any, name: str) -> bool:
    if isinstance(parent, ListConfig):
        return OmegaConf.is_interpolation(parent, int(name))
    return isinstance(parent, DictConfig) and OmegaConf.is_interpolation(parent, name)


def values(node: Any, pattern: str, prefix: str = "") -> Iterator[tuple[str, Any, Any, str]]:
    """(dotted key, value, the mapping or list holding it, its key there) of every key of
    ``node`` that ``pattern`` matches (values resolved)."""
    head, _, rest = pattern.partition(".")
    if isinstance(node, (Mapping, DictConfig)):
        present = [str(k) for k in node.keys()]   # `in` leaves out keys whose value is ???
        keys = present if head == "*" else [head] if head in present else []
        missing = [k for k in keys if isinstance(node, DictConfig) and OmegaConf.is_missing(node, k)]
        if missing:   # `???` in the config: a value the user must give
            raise FlashSpecError(f"{prefix}{missing[0]} is required (the config says ???); set it "
                                 f"on the command line, e.g. {prefix}{missing[0]}=...")
        items = [(k, node[k]) for k in keys]
    elif isinstance(node, (list, tuple, ListConfig)) and (head == "*" or head.isdigit()):
        idx = range(len(node)) if head == "*" else [int(head)] if int(head) < len(node) else []
        items = [(str(i), node[i]) for i in idx]
    else:
        return
    for key, child in items:
        name = f"{prefix}{key}"
        if rest:
            yield from values(child, rest, name + ".")
        else:
            yield name, child, node, key
