"""experiment=decode: target-only AR, speculative decoding and HF baselines on the same prompts.

Writes one JSONL record per (prompt, turn, method) into ``records.jsonl`` of the run
directory, flushed as it goes; rerunning into the same directory resumes where it stopped.
Prints and logs a summary table (α, τ, TPS, speedup per dataset and method).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from experiments.harness import (RunDir, build_arms, build_drafters, draft_context, engine_options,
                                 load_target, make_planner, make_policy, prompt_set, run_dir)
from flashspec.bandits import Policy
from flashspec.data import Prompt, chat_ids
from flashspec.engine import Arm, SpecEngine
from flashspec.errors import FlashSpecError
from flashspec.metrics import (bandit_vs_fixed, format_bandit_vs_fixed, format_table, percentile,
                               rates, summarize)
from flashspec.seeds import derive_seed
from flashspec.verify.sampling import SamplingParams

log = logging.getLogger(__name__)
METHODS = ("ar", "spec", "each_arm", "hf_generate", "hf_compiled", "hf_prompt_lookup")
HF_METHODS = {"hf_generate": {}, "hf_compiled": {"cache_implementation": "static"},
              "hf_prompt_lookup": {}}


@dataclass
class Method:
    """A named way to decode a batch: ``run(prompt_ids, max_new) -> list[dict]`` of row stats."""

    name: str
    run: Callable[[list[list[int]], int, str | None, int | None], list[dict[str, Any]]]


def engine_method(name: str, engine: SpecEngine) -> Method:
    def run(prompts: list[list[int]], max_new: int, domain: str | None,
            seed: int | None = None) -> list[dict[str, Any]]:
        res = engine.generate(prompts, max_new, domain=domain, seed=seed)
        return [{"tokens": r.tokens, "wall_s": res.wall_s, "decode_s": res.decode_s,
                 "steps": r.steps, "n_proposed": r.n_proposed, "n_accepted": r.n_accepted,
                 "accept_hist": r.accept_hist, "arms": r.arms, "rewards": r.rewards,
                 "step_p50_s": percentile(res.step_s, 50), "step_p99_s": percentile(res.step_s, 99),
                 "capture_s": res.capture_s}
                for r in res.rows]
    return Method(name, run)


def hf_method(name: str, hf_model, params: SamplingParams, eos: list[int], lookup: int | None,
              extra: dict[str, Any] | None = None) -> Method:
    """HF transformers' own generate (greedy or sampled), optionally with prompt lookup.

    ``extra`` goes to ``generate``: ``cache_implementation="static"`` makes transformers compile
    the decoding step (torch.compile, CUDA graphs) on a GPU: the ``hf_compiled`` baseline.
    """
    def run(prompts: list[list[int]], max_new: int, domain: str | None,
            seed: int | None = None) -> list[dict[str, Any]]:
        if seed is not None:
            torch.manual_seed(seed)
        out = []
        for p in prompts:
            ids = torch.tensor([p], device=hf_model.device)
            kwargs = dict(max_new_tokens=max_new, do_sample=not params.greedy, eos_token_id=eos,
                          pad_token_id=eos[0] if eos else None, **(extra or {}))
            if not params.greedy:
                kwargs.update(temperature=params.temperature, top_k=params.top_k or None,
                              top_p=params.top_p)
            if lookup:
                kwargs["prompt_lookup_num_tokens"] = lookup
            t0 = time.perf_counter()
            with torch.inference_mode():
                gen = hf_model.generate(ids, **kwargs)
            wall = time.perf_counter() - t0
            toks = gen[0, len(p):].tolist()
            out.append({"tokens": toks, "wall_s": wall, "decode_s": wall, "steps": len(toks),
                        "n_proposed": 0, "n_accepted": 0, "accept_hist": [], "arms": [],
                        "rewards": []})
        return out
    return Method(name, run)


def spec_name(arms: list[Arm], policy: Policy) -> str:
    """``spec:<arm>`` for a fixed arm, ``spec:bandit:<policy label>`` for a learning policy."""
    if not policy.learns:
        return f"spec:{arms[int(policy.select())].name}"
    return f"spec:bandit:{policy.label}"


def build_methods(cfg: DictConfig, target, tokenizer, params: SamplingParams, eos: list[int]) -> list[Method]:
    """The methods named in ``experiment.methods``, sharing one target model."""
    exp = cfg.experiment
    unknown = [m for m in exp.methods if m not in METHODS]
    if unknown:
        raise FlashSpecError(f"unknown decode method(s) {unknown}; choose from {list(METHODS)}")
    kw = engine_options(cfg, params, eos)
    methods: list[Method] = []
    arms: list[Arm] = []
    if {"spec", "each_arm"} & set(exp.methods):
        drafters = build_drafters(cfg.drafters, draft_context(cfg, target, tokenizer))
        arms = build_arms(cfg.drafters, drafters)
    for m in exp.methods:
        if m == "ar":
            methods.append(engine_method("ar", SpecEngine(target, [Arm(None, 0)], **kw)))
        elif m == "spec":
            for cfg_bandit in [cfg.bandit, *(exp.get("extra_bandits") or {}).values()]:
                policy = make_policy(cfg_bandit, len(arms), int(cfg.seed))
                planner = make_planner(cfg)
                name = spec_name(arms, policy) + ("" if planner is None else "+goodput")
                methods.append(engine_method(name, SpecEngine(target, arms, policy, planner=planner, **kw)))
        elif m == "each_arm":
            methods += [engine_method(f"spec:{a.name}", SpecEngine(target, [a], **kw)) for a in arms]
        else:
            lookup = int(exp.hf_prompt_lookup_tokens) if m == "hf_prompt_lookup" else None
            methods.append(hf_method(m, _hf_model(cfg, target), params, eos, lookup, HF_METHODS[m]))
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise FlashSpecError(f"two methods share a name: {names}")
    return methods


_HF_CACHE: dict = {}


def _hf_model(cfg: DictConfig, target):
    """The same target weights as an HF transformers model (for HF's own generate).

    A model directory (or a GGUF, through its converted directory) loads as usual; a dummy
    target gets an HF model of its config holding the native model's (random) weights.
    """
    from transformers import AutoModelForCausalLM
    from flashspec.models.loading import cache_root, hf_dir, resolve_dtype, smollm2_dir, source_config
    src, dtype = cfg.target.source, resolve_dtype(cfg.target.dtype)
    key = (src, cfg.hardware.device)
    if key not in _HF_CACHE:
        if src.startswith("dummy:"):
            model = AutoModelForCausalLM.from_config(source_config(src), dtype=dtype)
            state = {k if k.startswith("lm_head.") else "model." + k: v
                     for k, v in target.state_dict().items() if "inv_freq" not in k}
            model.load_state_dict(state, strict=False)
        else:
            directory = (smollm2_dir() if src == "smollm2" else
                         cache_root() / Path(src).stem if src.endswith(".gguf") else hf_dir(src))
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
        model.generation_config.max_cache_len = 4096  # one static cache size: no recompiles
        _HF_CACHE[key] = model.to(cfg.hardware.device).eval()
    return _HF_CACHE[key]


def prompt_turn_ids(tokenizer, prompt: Prompt, answers: list[str]) -> list[int]:
    return chat_ids(tokenizer, prompt.turns[:len(answers) + 1], answers)


def run(cfg: DictConfig) -> dict[str, Any]:
    """Decode every prompt with every method; returns the summary rows."""
    torch.manual_seed(int(cfg.seed))
    exp = cfg.experiment
    if int(exp.batch_size) < 1:
        raise FlashSpecError(f"experiment.batch_size must be >= 1, got {exp.batch_size}")
    params = SamplingParams(float(exp.temperature), int(exp.top_k), float(exp.top_p))
    dataset = prompt_set(cfg)
    max_new = 8 if cfg.smoke else dataset.max_new_tokens
    prompts = dataset.load(1 if cfg.smoke else None)
    target, tokenizer = load_target(cfg)
    eos = [int(tokenizer.eos_token_id)] if tokenizer.eos_token_id is not None else []
    methods = build_methods(cfg, target, tokenizer, params, eos)
    with run_dir(cfg, exp.records, _run_name()) as run:
        done = run.done_keys("method", "prompt_id", "turn")
        batches = [prompts[i:i + int(exp.batch_size)] for i in range(0, len(prompts), int(exp.batch_size))]
        if exp.warmup:  # untimed, on the first batch's prompts; its wall time is the cold start
            warm = [prompt_turn_ids(tokenizer, p, []) for p in batches[0]]
            cold: dict[str, float] = {}
            for m in methods:
                t0 = time.perf_counter()
                m.run(warm, 4, None)
                cold[m.name] = time.perf_counter() - t0
            run.provenance["cold_start_s"] = cold
        with tqdm(total=len(batches) * len(methods), desc="decode", unit="batch") as bar:
            for bi, batch in enumerate(batches):
                for m in _order(methods, bi, bool(exp.get("rotate_methods", True))):
                    _decode_batch(m, batch, bi, tokenizer, max_new, params, run, done)
                    bar.update()
        from flashspec.records import read_records
        records = list(read_records(run.writer.path))
        rows = summarize(records)
        log.info("records: %s\n%s", run.writer.path, format_table(rows))
        cmp = bandit_vs_fixed(records)
        if cmp is not None:
            log.info("%s", format_bandit_vs_fixed(cmp))
            run.logger.summary({f"pooled/{k}": cmp[k] for k in ("vs_best_fixed", "vs_mean_fixed")})
        _stream_figure(records, cfg, run.path)
        run.logger.table("summary", rows)
        run.logger.summary({f"{r['dataset']}/{r['method']}/{k}": r[k] for r in rows
                            for k in ("alpha", "tau", "tps", "speedup") if r[k] is not None})
    return {"summary": rows, "records": str(run.writer.path)}


def _order(methods: list[Method], batch_id: int, rotate: bool) -> list[Method]:
    """Method order for one batch: rotated by the batch index so that no method always runs
    first (on an H200 the method run right after the slow HF eager baselines was ~15-25 %
    slower than the identical engine run later in the same batch)."""
    k = batch_id % len(methods) if rotate else 0
    return methods[k:] + methods[:k]


def _stream_figure(records: list[dict], cfg: DictConfig, out_dir: Path) -> None:
    """``stream.png``: arm chosen per step against the prompt's domain, for bandit methods."""
    if not any(r.get("method", "").startswith("spec:bandit") for r in records):
        return
    import matplotlib
    matplotlib.use("Agg")
    from flashspec.analysis.bandit_stream_plot import plot_stream
    from experiments.harness import arm_pairs
    plot_stream(records, [f"{name}@{gamma}" for name, gamma in arm_pairs(cfg.drafters)],
                out_dir / "stream.png")
    log.info("figure: %s", out_dir / "stream.png")


def _decode_batch(method: Method, batch: list[Prompt], batch_id: int, tokenizer, max_new: int,
                  params: SamplingParams, run: RunDir, done: set) -> None:
    """All turns of one batch of prompts with one method (turn 2 follows the method's own answer)."""
    if all((method.name, p.id, t) in done for p in batch for t in range(len(p.turns))):
        return
    answers: dict[str, list[str]] = {p.id: [] for p in batch}
    for turn in range(max(len(p.turns) for p in batch)):
        rows = [p for p in batch if len(p.turns) > turn]
        ids = [prompt_turn_ids(tokenizer, p, answers[p.id]) for p in rows]
        seed = derive_seed(run.seed, (method.name, tuple(p.id for p in rows), turn))
        stats = method.run(ids, max_new, rows[0].domain, seed)
        for p, prompt_ids, st in zip(rows, ids, stats):
            text = tokenizer.decode(st["tokens"], skip_special_tokens=True)
            answers[p.id].append(text)
            if (method.name, p.id, turn) in done:
                continue
            rec = _record(method.name, p, turn, prompt_ids, st, text, batch_id, len(rows), params)
            run.write(rec)
            run.logger.log({f"{p.dataset}/{method.name}/{k}": rec[k] for k in ("tps", "alpha", "tau")
                        if rec[k] is not None})


def _record(method: str, p: Prompt, turn: int, prompt_ids: list[int], st: dict, text: str,
            batch_id: int, batch_size: int, params: SamplingParams) -> dict[str, Any]:
    n_new = len(st["tokens"])
    steps = st["steps"]
    return {"experiment": "decode", "method": method, "dataset": p.dataset, "prompt_id": p.id,
            "domain": p.domain, "category": p.category, "turn": turn,
            "n_prompt_tokens": len(prompt_ids), "n_new_tokens": n_new, "wall_s": st["wall_s"],
            "decode_s": st["decode_s"], "tps": n_new / st["wall_s"] if st["wall_s"] else None,
            "decode_tps": n_new / st["decode_s"] if st["decode_s"] else None, "steps": steps,
            "n_proposed": st["n_proposed"], "n_accepted": st["n_accepted"],
            **rates(st["n_accepted"], st["n_proposed"], steps),
            "accept_hist": st["accept_hist"], "arms": st["arms"], "rewards": st["rewards"],
            "step_p50_s": st.get("step_p50_s"), "step_p99_s": st.get("step_p99_s"),
            "capture_s": st.get("capture_s", 0.0),
            **{k: st[k] for k in ("head_s", "head_calls") if k in st},
            "gamma": max((len(st["accept_hist"]) - 1), 0), "batch_size": batch_size,
            "batch_id": f"{method}:{batch_id}:{turn}", "temperature": params.temperature,
            "tokens": st["tokens"], "text": text}


def _run_name() -> str | None:
    try:
        from hydra.core.hydra_config import HydraConfig
        return HydraConfig.get().job.override_dirname or "default"
    except Exception:
        return None
