"""experiment=head_decode: one drafter with several LM heads on the same prompts (SlimSpec check).

Each head variant (full, low-rank at several ranks from the SVD or trained, top-k truncation)
drafts for the same drafter and γ; every variant decodes the same prompts (plus target-only AR)
in one process. The variants' heads are also timed alone on the drafter's hidden size, so the
run gives, per dataset and variant:

- ρ_τ = τ(variant) / τ(full);
- ν = head latency(variant) / head latency(full);
- κ = γ · full-head latency / (full-head step latency − γ · full-head latency);
- predicted ρ_TPS = ρ_τ (1 + κ) / (1 + ν κ) (SlimSpec), with ν and κ from the heads timed
  alone and, as ``*_loop``, from the heads timed inside the decode loop (:class:`TimedHead`;
  eager runtimes only: a captured runtime keeps its graphs and reports no ``*_loop`` columns);
  measured ρ_TPS = decode TPS(variant) / decode TPS(full); on wall time with the prefill
  (DESIGN's TPS) as ``rho_tps_meas_wall``, predicted by ``rho_tps_pred_wall`` from the full
  head's measured prefill and decode seconds.

Records: ``records.jsonl`` (one per prompt, turn and method, as experiment=decode writes) and
``head_summary.jsonl``; figure ``rho_tps.png`` (predicted against measured).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from experiments.decode import Method, _decode_batch, engine_method, prompt_turn_ids
from experiments.harness import (build, draft_context, engine_options, load_target, prompt_set,
                                 run_dir)
from flashspec.core import Arm, SamplingParams
from flashspec.engine import SpecEngine
from flashspec.errors import FlashSpecError
from flashspec.heads import FullHeadChoice
from flashspec.metrics import format_table, summarize
from flashspec.records import RecordWriter, read_records
from flashspec.analysis.head_timing import head_latency
from flashspec.theory import kappa as kappa_of
from flashspec.theory import rho_tps

log = logging.getLogger(__name__)


def build_variants(cfg: DictConfig, target, tokenizer) -> list[tuple[str, Any]]:
    """(name, drafter) per head variant; the first one is the full-head reference."""
    exp = cfg.experiment
    variants = {k: v for k, v in exp.variants.items() if v is not None}
    heads = {name: build(v.head) for name, v in variants.items()}
    if not heads or not isinstance(next(iter(heads.values())), FullHeadChoice):
        raise FlashSpecError("experiment.variants must start with the full head ({full: {head: "
                             "{_target_: flashspec.heads.FullHeadChoice}}}): every ratio is taken "
                             "against it")
    ctx = draft_context(cfg, target, tokenizer)
    out = []
    for name, v in variants.items():
        entry = OmegaConf.merge(exp.drafter, v.get("drafter") or {})
        make = build(entry, _partial_=True)
        out.append((name, make(ctx=ctx, name=f"{exp.drafter_name}[{name}]", head=heads[name])))
    return out


def head_rows(summary: list[dict], latencies: dict[str, float], step_s: dict[str, float],
              gamma: int, methods: dict[str, str],
              phases: dict[tuple[str, str], dict[str, float]] | None = None,
              loop: dict[tuple[str, str], dict[str, float]] | None = None) -> list[dict[str, Any]]:
    """Per dataset and variant: ρ_τ, ν, κ, predicted and measured ρ_TPS.

    ``latencies`` are the heads timed alone (SlimSpec's ν and κ). ``loop[(dataset, method)]``
    (:func:`loop_stats`) has the heads timed inside the decode loop: ``nu_loop`` / ``kappa_loop``
    and ``rho_tps_pred_loop``. With ``phases`` (:func:`phase_seconds`), ``rho_tps_meas`` is the
    decode-throughput ratio, the quantity the model describes. ``rho_tps_meas_wall`` is the
    ratio of wall-time TPS with the prefill included (DESIGN's TPS), and ``rho_tps_pred_wall``
    predicts it: the full head's measured prefill P and decode D, with the variant's decode
    shortened by the predicted ratio, (P + D) / (P + D / ρ) (the in-loop ρ where there is one).
    """
    by = {(r["dataset"], r["method"]): r for r in summary}
    full = methods["full"]
    rows = []
    for dataset in sorted({r["dataset"] for r in summary}):
        ref = by.get((dataset, full))
        if ref is None:
            continue
        t_head = latencies["full"]
        kappa = kappa_of(gamma, t_head, step_s[dataset])
        lf = (loop or {}).get((dataset, full))
        pf = (phases or {}).get((dataset, full))
        for name, method in methods.items():
            r = by.get((dataset, method))
            if r is None:
                continue
            rho_tau = r["tau"] / ref["tau"]
            nu = latencies[name] / t_head
            row = {"dataset": dataset, "variant": name, "method": method, "tau": r["tau"],
                   "rho_tau": rho_tau, "nu": nu, "kappa": kappa,
                   "rho_tps_pred": rho_tps(rho_tau, nu, kappa),
                   "rho_tps_meas": r["tps"] / ref["tps"], "rho_tps_meas_wall": r["tps"] / ref["tps"],
                   "tps": r["tps"], "head_latency_s": latencies[name], "gamma": gamma}
            lv = (loop or {}).get((dataset, method))
            if lf and lv and lf["call_s"] > 0:
                head = lf["head_per_step"]
                row["nu_loop"] = nu_loop = lv["call_s"] / lf["call_s"]
                row["kappa_loop"] = k_loop = head / max(lf["step"] - head, 1e-9)
                row["rho_tps_pred_loop"] = rho_tps(rho_tau, nu_loop, k_loop)
            pv = (phases or {}).get((dataset, method))
            if pf and pv:
                row["rho_tps_meas"] = (pv["tokens"] / pv["decode"]) / (pf["tokens"] / pf["decode"])
                pred = row.get("rho_tps_pred_loop", row["rho_tps_pred"])
                prefill = pf["wall"] - pf["decode"]
                row["rho_tps_pred_wall"] = (prefill + pf["decode"]) / (prefill + pf["decode"] / pred)
            rows.append(row)
    return rows


def loop_stats(records: list[dict]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (dataset, method) with ``head_s`` / ``head_calls`` records: mean seconds per head
    call (``call_s``), head seconds per decode step and decode seconds per step."""
    acc: dict[tuple[str, str], list[float]] = {}
    for r in records:
        if r.get("head_calls"):
            a = acc.setdefault((r["dataset"], r["method"]), [0.0, 0.0, 0.0, 0.0])
            for i, k in enumerate(("head_s", "head_calls", "steps", "decode_s")):
                a[i] += r[k]
    return {k: {"call_s": h / n, "head_per_step": h / steps, "step": d / steps}
            for k, (h, n, steps, d) in acc.items() if n and steps}


class TimedHead(torch.nn.Module):
    """A drafter's head with a stopwatch: seconds and calls while ``on`` (synchronised on CUDA).

    It wraps the drafter's reference to the head only, so a head the target shares (EAGLE's
    full head is the target's own) is not timed when the target calls it.
    """

    def __init__(self, head: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.on, self.seconds, self.calls = head, False, 0.0, 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not self.on:
            return self.inner(h)
        _sync(h)
        t0 = time.perf_counter()
        out = self.inner(h)
        _sync(out)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


def _sync(x: torch.Tensor) -> None:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)


def timed_method(m: Method, clock: TimedHead) -> Method:
    """``m`` whose rows also carry the head seconds and calls of that decode call."""
    def run(prompts: list[list[int]], max_new: int, domain: str | None,
            seed: int | None = None, learn: bool = True) -> list[dict[str, Any]]:
        clock.seconds, clock.calls, clock.on = 0.0, 0, True
        try:
            rows = m.run(prompts, max_new, domain, seed, learn)
        finally:
            clock.on = False
        return [{**r, "head_s": clock.seconds, "head_calls": clock.calls} for r in rows]
    return Method(m.name, run)


def phase_seconds(records: list[dict]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (dataset, method): new tokens, wall seconds and decode seconds, summed."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for r in records:
        acc = out.setdefault((r["dataset"], r["method"]), {"tokens": 0.0, "wall": 0.0, "decode": 0.0})
        acc["tokens"] += r["n_new_tokens"]
        acc["wall"] += r["wall_s"]
        acc["decode"] += r["decode_s"]
    return {k: v for k, v in out.items() if v["decode"] > 0}


def rows_from_records(records: list[dict], latencies: dict[str, float], gamma: int,
                      methods: dict[str, str], summary: list[dict] | None = None) -> list[dict[str, Any]]:
    """:func:`head_rows` from one run's decode records (``summary``: their ``summarize``)."""
    return head_rows(summary if summary is not None else summarize(records), latencies,
                     _step_seconds(records, methods["full"]), gamma, methods,
                     phase_seconds(records), loop_stats(records))


def run(cfg: DictConfig) -> dict[str, Any]:
    """Decode the prompts with every head variant (and AR); write records, summary and figure."""
    torch.manual_seed(int(cfg.seed))
    exp = cfg.experiment
    gamma = int(exp.gamma)
    params = SamplingParams(float(exp.temperature), 0, 1.0)
    dataset = prompt_set(cfg)
    max_new = 8 if cfg.smoke else dataset.max_new_tokens
    prompts = dataset.load(1 if cfg.smoke else None)
    target, tokenizer = load_target(cfg)
    eos = [int(tokenizer.eos_token_id)] if tokenizer.eos_token_id is not None else []
    kw = engine_options(cfg, params, eos)
    # The in-loop stopwatch (TimedHead) needs eager steps: under a captured runtime the head runs
    # inside graph replays, so there the loop keeps its runtime (the step whose share κ is) and
    # the heads are timed alone only (CUDA-graph timed, :func:`head_latency`).
    in_loop = not (kw["graphs"] and target.device.type == "cuda")
    if in_loop:
        kw = {**kw, "graphs": False}
    variants = build_variants(cfg, target, tokenizer)
    iters = 5 if cfg.smoke else int(exp.timing_iters)
    # the heads alone, before any gets the in-loop stopwatch
    latencies = {name: head_latency(d.head, _hidden(d.head, target), target.device, target.dtype,
                                    iters) for name, d in variants}
    methods = [engine_method("ar", SpecEngine(target, [Arm()], **kw))]
    names: dict[str, str] = {}
    for name, drafter in variants:
        arm = Arm(drafter.name, gamma)
        names[name] = f"spec:{arm.label}"
        if in_loop:
            drafter.head = clock = TimedHead(drafter.head)
        method = engine_method(names[name], SpecEngine(target, [arm], drafters=[drafter], **kw))
        methods.append(timed_method(method, clock) if in_loop else method)
    with run_dir(cfg, "records.jsonl", data=dataset.name) as run:
        done = run.done_keys("method", "prompt_id", "turn")
        warm = prompt_turn_ids(tokenizer, prompts[0], [])
        for m in methods:
            m.run([warm], 4, None, learn=False)
        with tqdm(total=len(prompts) * len(methods), desc="head_decode", unit="prompt") as bar:
            for i, p in enumerate(prompts):
                for m in methods:
                    _decode_batch(m, [p], i, tokenizer, max_new, params, run, done)
                    bar.update()
        records = list(read_records(run.writer.path))
        summary = summarize(records)
        rows = rows_from_records(records, latencies, gamma, names, summary)
        head_writer = RecordWriter(run.path / "head_summary.jsonl")
        for r in rows:
            head_writer.write({"experiment": "head_decode", **r, "provenance": run.provenance})
        log.info("records: %s\n%s\n\n%s", run.writer.path, format_table(summary), _table(rows))
        _figure(rows, run.path / "rho_tps.png")
        run.logger.table("head_summary", rows)
    return {"summary": summary, "heads": rows}


def _hidden(head: torch.nn.Module, target) -> int:
    """The width of the hidden vector a drafter's head reads (a separate draft LM's own d)."""
    if hasattr(head, "hidden_size"):                      # FlashSpec's heads
        return int(head.hidden_size)
    if isinstance(head, torch.nn.Linear):                 # a model's own LM head (the full one)
        return int(head.in_features)
    return int(target.shape.hidden_size)


def _step_seconds(records: list[dict], method: str) -> dict[str, float]:
    """Mean decode seconds per speculative step of ``method``, per dataset."""
    out: dict[str, list[float]] = {}
    for r in records:
        if r["method"] == method and r["steps"]:
            out.setdefault(r["dataset"], []).append((r["decode_s"], r["steps"]))
    return {d: sum(s for s, _ in v) / sum(n for _, n in v) for d, v in out.items()}


def _table(rows: list[dict[str, Any]]) -> str:
    cols = ["dataset", "variant", "tau", "rho_tau", "nu", "kappa", "nu_loop", "kappa_loop",
            "rho_tps_pred", "rho_tps_pred_loop", "rho_tps_meas", "rho_tps_pred_wall",
            "rho_tps_meas_wall"]
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else ("-" if v is None else str(v))
    cells = [cols] + [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells)


def _figure(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    from flashspec.analysis.head_plot import plot_rho_tps
    plot_rho_tps(rows, path)
