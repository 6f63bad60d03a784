"""Kernel benchmark: fused Triton verify vs the PyTorch reference (eager and torch.compile).

``python run.py experiment=kernel_bench hardware=h200 [runtime=...] [smoke=true]`` (the runtime
group picks the kernel switches; ``experiment.precompile=N`` compiles every shape's kernels in N
processes before timing, on a GPU).

Per shape (B, γ, V): median µs per verify call (CUDA events around each call, warm-up
excluded, inputs rotated over enough buffers to defeat the L2), speedup vs the eager
reference, ratio to the memory floor (bytes read once / hardware.mem_bandwidth_gbs), whether
kernel and reference return identical tokens and counts, whether verify runs without a
device-to-host sync (``torch.cuda.set_sync_debug_mode("error")``) and inside a CUDA graph with
a device seed. On CPU or with smoke=true a tiny shape set runs (interpreted Triton).
"""
from __future__ import annotations

import math
import os
import statistics
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from flashspec.core import SamplingParams
from flashspec.errors import FlashSpecError
from flashspec.options import DEFAULT, KernelOptions
from flashspec.records import NullLogger, RecordWriter, provenance
from flashspec.verify import reference

RECORDS = "kernel_bench.jsonl"
FIGURE = "kernel_bench_speedup.png"


# ----------------------------------------------------------------------------- inputs
def make_inputs(batch: int, gamma: int, vocab: int, dtype: torch.dtype, draft: str,
                temperature: float, device: torch.device, gen: torch.Generator):
    """Target logits, draft tokens sampled from q, draft logits q (None for one-hot)."""
    x = torch.randn(batch, gamma + 1, vocab, device=device, generator=gen) * 3.0
    q = x[:, :gamma] + torch.randn(batch, gamma, vocab, device=device, generator=gen)
    probs = torch.softmax(q.float() / max(temperature, 1e-3), dim=-1).reshape(-1, vocab)
    tokens = torch.multinomial(probs, 1, generator=gen).reshape(batch, gamma)
    return x.to(dtype), tokens, (q.to(dtype) if draft == "full" else None)


def bytes_min(batch: int, gamma: int, vocab: int, dtype: torch.dtype, draft: str) -> int:
    """Bytes any verify must move: logits read once, tokens read, outputs written."""
    elt = torch.finfo(dtype).bits // 8
    logits = batch * (gamma + 1) * vocab + (batch * gamma * vocab if draft == "full" else 0)
    return logits * elt + batch * gamma * 8 + batch * (gamma + 2) * 8


# ----------------------------------------------------------------------------- timing
def time_calls(fn: Callable, buffers: list, iters: int, warmup: int, cuda: bool) -> list[float]:
    """µs per call: CUDA events around each call (GPU) or perf_counter (CPU)."""
    for i in range(warmup):
        fn(*buffers[i % len(buffers)])
    if not cuda:
        out = []
        for i in range(iters):
            t0 = time.perf_counter()
            fn(*buffers[i % len(buffers)])
            out.append((time.perf_counter() - t0) * 1e6)
        return out
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(iters)]
    for i, (a, b) in enumerate(ev):
        a.record()
        fn(*buffers[i % len(buffers)])
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 for a, b in ev]


def graph_time(verify: Callable, buffers: list, params: SamplingParams, replays: int,
               min_calls: int = 8) -> tuple[float, list[dict]]:
    """µs per call from replays of one CUDA graph holding at least ``min_calls`` calls (the
    buffers in turn), timed back to back; then the rows where captured calls, replayed with a
    new device seed, differ from the reference (each with the same call made eagerly with that
    seed, and the reference's margins). The checks run after the timing: the reference's
    float32 temporaries would leave the L2 dirty for the next replay."""
    seed = torch.zeros((), dtype=torch.int64, device="cuda")
    verify(*buffers[0], params, seed)                       # warm (compile, workspaces)
    torch.cuda.synchronize()
    n_calls = max(min_calls, len(buffers))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [verify(*buffers[i % len(buffers)], params, seed) for i in range(n_calls)]
    graph.replay()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(replays)]
    for a, b in ev:
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) * 1e3 / n_calls for a, b in ev]
    bad = []
    for r in range(2):
        seed.fill_(1000 + r)
        graph.replay()
        torch.cuda.synchronize()
        for i in range(len(buffers)):
            last = max(k for k in range(n_calls) if k % len(buffers) == i)
            bad += _graph_mismatches(verify, buffers[i], outs[last], params, 1000 + r,
                                     f"graph replay {r} buffer {i}")
    del graph
    return statistics.median(times), bad


def _graph_mismatches(verify: Callable, args: tuple, out: tuple, params: SamplingParams,
                      seed: int, where: str) -> list[dict]:
    """Rows where a replayed call differs from the reference, with the eager call's answer."""
    ref = reference.verify(*args, params, seed)
    rows = mismatches(ref, out, where)
    if rows:
        eager = verify(*args, params, seed)
        for row in rows:
            b_ = row["row"]
            row["eager_same_seed"] = eager[0][b_].tolist()
            row["eager_matches_ref"] = bool(torch.equal(eager[0][b_], ref[0][b_])
                                            and eager[1][b_] == ref[1][b_])
            row["margins"] = margins(args, params, seed, b_)
    return rows


def margins(args: tuple, params: SamplingParams, seed: int, row: int) -> dict:
    """How close the reference's decisions of one row are to a tie: per draft, log u minus
    (log p - log q) of the accept test; at j* the gap between the two best race keys."""
    from flashspec.verify import rng
    x, tokens, q = (a[row:row + 1] if a is not None else None for a in args)
    batch, gamma = args[1].shape
    temps = reference.row_temperatures(params, None, 1, x.device)
    logp = reference.warp_rows(x, params, temps)[0]
    logq = reference.draft_logprobs(tokens, q, params, temps, x.shape[-1])[0]
    t = tokens[0].long()
    streams = row * (gamma + 1) + torch.arange(gamma + 1, device=x.device)
    u = rng.uniform(seed, streams[:gamma], torch.tensor(x.shape[-1], device=x.device))
    acc = (torch.log(u) - (logp[:gamma].gather(-1, t[:, None])[:, 0]
                           - logq.gather(-1, t[:, None])[:, 0]))
    n = int(((acc < 0).int().cumprod(0)).sum())
    w = logp[n].exp() if n == gamma else reference.race_weights(logp[n], logq[n])
    masses = reference.blocks_of(w).sum(-1)
    blocks = torch.arange(masses.shape[-1], device=x.device)
    ub = rng.uniform(seed, streams[n], x.shape[-1] + 1 + blocks)
    keys = masses.log() - torch.log(-torch.log(ub))
    top = keys.topk(min(2, keys.shape[-1])).values
    return {"accept_margin": [float(v) for v in acc[:n + 1]], "jstar": n,
            "race_block_top2_gap": float(top[0] - top[-1])}


def mismatches(ref: tuple, got: tuple, where: str, limit: int = 4) -> list[dict]:
    """Rows whose tokens or count differ, with both answers (at most ``limit``)."""
    rows = ((ref[0] != got[0]).any(1) | (ref[1] != got[1])).nonzero().flatten().tolist()
    return [{"where": where, "row": b, "ref_n": int(ref[1][b]), "got_n": int(got[1][b]),
             "ref": ref[0][b].tolist(), "got": got[0][b].tolist()} for b in rows[:limit]]


def no_host_sync(verify: Callable, args: tuple, params: SamplingParams) -> bool:
    """True when verify (device seed) runs under set_sync_debug_mode('error')."""
    seed = torch.tensor(7, dtype=torch.int64, device="cuda")
    verify(*args, params, seed)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        verify(*args, params, seed)
        return True
    except RuntimeError:
        return False
    finally:
        torch.cuda.set_sync_debug_mode(0)


def compare(verify: Callable, args: tuple, params: SamplingParams, seeds: list[int],
            label: str) -> list[dict]:
    """Rows whose tokens or count differ between kernel and reference, over the seeds."""
    bad = []
    for s in seeds:
        bad += mismatches(reference.verify(*args, params, s), verify(*args, params, s),
                          f"{label} seed {s}")
    return bad


# ----------------------------------------------------------------------------- one shape
def bench_shape(knobs: dict, shape: tuple[int, int, int], device: torch.device,
                bandwidth_gbs: float, compiled: Callable | None, seed: int,
                options: KernelOptions = DEFAULT) -> dict:
    """Every measurement of one (B, γ, V), the kernels run with ``options``."""
    from flashspec.verify import triton_backend as tb
    verify = tb.make_backend(options).verify
    batch, gamma, vocab = shape
    dtype, draft = getattr(torch, knobs["dtype"]), knobs["draft"]
    cuda = device.type == "cuda"
    need = bytes_min(batch, gamma, vocab, dtype, draft)
    per_set = need if cuda else 1
    n_buf = max(2, min(int(knobs["max_buffers"]), math.ceil(3 * knobs["l2_bytes"] / per_set)))
    n_buf = n_buf if cuda else 2
    gen = torch.Generator(device=device).manual_seed(seed)
    params = SamplingParams(temperature=float(knobs["temperature"]))
    buffers = [make_inputs(batch, gamma, vocab, dtype, draft, params.temperature, device, gen)
               for _ in range(n_buf)]
    run = lambda *b: verify(*b, params, 3)                          # noqa: E731
    variants = {"fused": lambda *a: tb.launch(*a, fused=True, options=options),
                "unfused": lambda *a: tb.launch(*a, fused=False, options=options)}
    ref = lambda *b: reference.verify(*b, params, 3)                # noqa: E731
    it, rit, wu = int(knobs["iters"]), int(knobs["ref_iters"]), int(knobs["warmup"])
    plan = tb.plan(batch, gamma, vocab)
    direct = options.direct_launch and not tb.INTERPRET
    rec: dict[str, Any] = {"B": batch, "gamma": gamma, "V": vocab, "dtype": knobs["dtype"],
                           "draft": draft, "temperature": params.temperature, "n_buffers": n_buf,
                           "bytes_min": need, "device": str(device),
                           "fused": tb._resolve_fused(None, plan, options),
                           "direct_launch": direct, "interpreted": tb.INTERPRET}
    seeds = list(knobs["check_seeds"])
    bad = compare(verify, buffers[0], params, seeds, "default")
    for name, fn in variants.items():
        bad += compare(fn, buffers[0], params, seeds, name)
    rec["identical"], rec["mismatches"] = not bad, bad
    rec["tau"] = float(verify(*buffers[0], params, 3)[1].float().mean()) + 1.0
    kernel = time_calls(run, buffers, it, wu, cuda)
    rec["kernel_us"] = statistics.median(kernel)
    rec["kernel_p90_us"] = sorted(kernel)[int(0.9 * (len(kernel) - 1))]
    for name, fn in variants.items():
        timed = lambda *b, fn=fn: fn(*b, params, 3)                 # noqa: E731
        rec[f"kernel_{name}_us"] = statistics.median(time_calls(timed, buffers, it, wu, cuda))
    if direct:                               # the same call through Triton's own launcher
        binder = tb.make_backend(replace(options, direct_launch=False)).verify
        rec["kernel_triton_launch_us"] = statistics.median(
            time_calls(lambda *b: binder(*b, params, 3), buffers, it, wu, cuda))
    rec["ref_eager_us"] = statistics.median(time_calls(ref, buffers, rit, min(wu, 3), cuda))
    rec["ref_compiled_us"] = None
    if compiled is not None:
        comp = lambda *b: compiled(*b, params, 3)                   # noqa: E731
        try:
            rec["ref_compiled_us"] = statistics.median(time_calls(comp, buffers, rit, 3, cuda))
        except Exception as e:                                       # inductor failures
            lines = [ln for ln in str(e).splitlines() if "Error" in ln] or [str(e)]
            rec["compiled_error"] = f"{type(e).__name__}: {lines[0].strip()[:400]}"
    rec["floor_us"] = need / (bandwidth_gbs * 1e3)
    rec["speedup_eager"] = rec["ref_eager_us"] / rec["kernel_us"]
    rec["speedup_compiled"] = (rec["ref_compiled_us"] / rec["kernel_us"]
                               if rec["ref_compiled_us"] else None)
    rec["floor_ratio"] = rec["kernel_us"] / rec["floor_us"]
    rec["no_host_sync"] = no_host_sync(verify, buffers[0], params) if cuda else None
    rec["kernel_graph_us"], rec["graph_identical"] = None, None
    if cuda and int(knobs["graph_replays"]) > 0:
        gbad = []
        for name, fn in variants.items():
            us, vbad = graph_time(fn, buffers, params, int(knobs["graph_replays"]))
            rec[f"kernel_graph_{name}_us"] = us
            rec[f"graph_identical_{name}"] = not vbad
            gbad += [dict(r, variant=name) for r in vbad]
        rec["kernel_graph_us"] = rec["kernel_graph_fused_us" if rec["fused"]
                                     else "kernel_graph_unfused_us"]
        rec["graph_identical"], rec["graph_mismatches"] = not gbad, gbad
    rec["graph_floor_ratio"] = (rec["kernel_graph_us"] / rec["floor_us"]
                                if rec["kernel_graph_us"] else None)
    rec["graph_speedup_eager"] = (rec["ref_eager_us"] / rec["kernel_graph_us"]
                                  if rec["kernel_graph_us"] else None)
    rec["plan"] = plan.__dict__
    return rec


# ----------------------------------------------------------------------------- driver
def compile_reference() -> Callable:
    """torch.compile(reference.verify, dynamic=True) with 64-bit indexing in generated kernels.

    Inductor (torch 2.11, triton 3.6) emits `2654435769*x0` for the stream hash on int32 index
    variables, which Triton rejects ("Scalar 2654435769 is out of range for type int32");
    forcing int64 indices avoids it (and can only make the compiled reference slower).
    """
    from torch._inductor.codegen import simd
    if hasattr(simd.SIMDScheduling, "can_use_32bit_indexing"):
        simd.SIMDScheduling.can_use_32bit_indexing = staticmethod(lambda *a, **k: False)
    return torch.compile(reference.verify, dynamic=True)


def shapes_of(knobs: dict) -> list[tuple[int, int, int]]:
    """The explicit ``shapes`` list [[B, γ, V], ...] if given, else batches × gammas × vocabs."""
    if knobs.get("shapes"):
        return [tuple(int(x) for x in s) for s in knobs["shapes"]]
    return [(b, g, v) for v in knobs["vocabs"] for g in knobs["gammas"] for b in knobs["batches"]]


def bench(knobs: dict, device: torch.device, bandwidth_gbs: float, out_dir: Path,
          config: dict, seed: int, logger: NullLogger | None = None,
          options: KernelOptions = DEFAULT) -> dict:
    """All shapes; one JSONL record per shape (flushed), then the figure."""
    writer = RecordWriter(out_dir / RECORDS)
    compiled = compile_reference() if knobs.get("compile_ref") and device.type == "cuda" else None
    prov = provenance(config, seed)
    t0, rows = time.time(), []
    try:
        from tqdm import tqdm
    except ImportError:                                                  # pragma: no cover
        tqdm = lambda x, **k: x                                          # noqa: E731
    for shape in tqdm(shapes_of(knobs), desc="kernel_bench"):
        use = compiled if time.time() - t0 < float(knobs["time_budget_s"]) else None
        rec = bench_shape(knobs, shape, device, bandwidth_gbs, use, seed, options)
        rec["compiled_skipped"] = compiled is not None and use is None
        if rec.get("compiled_error"):
            compiled = None                                  # failed once: eager only from here
        rec.update(experiment="kernel_bench", provenance=prov)
        writer.write(rec)
        rows.append(rec)
        print(_row(rec), flush=True)
        if logger is not None:
            logger.log({k: v for k, v in rec.items() if isinstance(v, (int, float))})
    plot(rows, out_dir / FIGURE)
    summary = summarize(rows)
    if logger is not None:
        logger.table("kernel_bench", [{k: v for k, v in r.items() if k != "provenance"}
                                      for r in rows])
        logger.summary(summary)
    return summary


def summarize(rows: list[dict]) -> dict:
    """Gate inputs plus the issue's bars: B=1 speedup, floor ratio at B=64, γ=4, V=128256."""
    ok = [r["identical"] and r.get("graph_identical") is not False for r in rows]
    b1 = [r["speedup_eager"] for r in rows if r["B"] == 1]
    bar = [r for r in rows if (r["B"], r["gamma"], r["V"]) == (64, 4, 128256)]
    return {"n_records": len(rows), "all_identical": all(ok),
            "eager_identical": all(r["identical"] for r in rows),
            "graph_identical": all(r.get("graph_identical") is not False for r in rows),
            "min_speedup_eager": min(r["speedup_eager"] for r in rows),
            "min_speedup_eager_B1": min(b1) if b1 else None,
            "bar_floor_ratio_eager": bar[0]["floor_ratio"] if bar else None,
            "bar_floor_ratio_graph": bar[0].get("graph_floor_ratio") if bar else None,
            "no_host_sync": all(r["no_host_sync"] is not False for r in rows)}


def _row(r: dict) -> str:
    """One line per shape: times (µs), speedups vs the eager reference, floor ratios, checks."""
    def f(key: str, width: int = 7, prec: int = 1) -> str:
        v = r.get(key)
        return f"{v:{width}.{prec}f}" if isinstance(v, (int, float)) else "-".rjust(width)
    return (f"B={r['B']:3d} γ={r['gamma']} V={r['V']:6d} | ref {f('ref_eager_us', 8)} | kernel "
            f"{f('kernel_us')} (fused {f('kernel_fused_us')} unfused {f('kernel_unfused_us')} "
            f"triton-launch {f('kernel_triton_launch_us')}) graph {f('kernel_graph_us')} "
            f"(fused {f('kernel_graph_fused_us')} unfused {f('kernel_graph_unfused_us')}) µs | "
            f"x{f('speedup_eager', 6)} graph x{f('graph_speedup_eager', 6)} | floor "
            f"{f('floor_us', 6)} µs ratio {f('floor_ratio', 5, 2)} graph "
            f"{f('graph_floor_ratio', 5, 2)} | same={r['identical']} "
            f"graph_same={r['graph_identical']} nosync={r['no_host_sync']} fused={r['fused']} direct={r.get('direct_launch')}")


def plot(rows: list[dict], path: Path) -> None:
    """Speedup vs eager over B, one line per V, one panel per γ; kernel / floor below."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    gammas = sorted({r["gamma"] for r in rows})
    fig, axes = plt.subplots(2, len(gammas), figsize=(5 * len(gammas), 7), squeeze=False)
    for col, g in enumerate(gammas):
        for v in sorted({r["V"] for r in rows}):
            sel = sorted((r for r in rows if r["gamma"] == g and r["V"] == v), key=lambda r: r["B"])
            bs = [r["B"] for r in sel]
            line, = axes[0][col].plot(bs, [r["speedup_eager"] for r in sel], "o-",
                                      label=f"V={v}")
            axes[1][col].plot(bs, [r["floor_ratio"] for r in sel], "o-", color=line.get_color())
            graph = [r.get("graph_floor_ratio") for r in sel]
            if all(isinstance(x, float) for x in graph):
                axes[1][col].plot(bs, graph, "o:", mfc="none", color=line.get_color())
        axes[0][col].set(title=f"γ={g}", xscale="log", yscale="log", xlabel="batch B",
                         ylabel="speedup vs eager reference")
        axes[1][col].set(xscale="log", yscale="log", xlabel="batch B",
                         ylabel="kernel time / memory floor\n(filled: eager calls, open: graph)")
        axes[1][col].axhline(1.0, color="gray", lw=0.8)
        axes[1][col].axhline(2.5, color="gray", lw=0.8, ls="--")
        axes[0][col].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _warm_shape(job: tuple) -> str:
    """Compile every kernel variant one shape uses (fills Triton's on-disk cache)."""
    knobs, shape, seed, device_name, options = job
    from flashspec.verify import triton_backend as tb
    batch, gamma, vocab = shape
    device = torch.device(device_name)
    gen = torch.Generator(device=device).manual_seed(seed)
    params = SamplingParams(temperature=float(knobs["temperature"]))
    args = make_inputs(batch, gamma, vocab, getattr(torch, knobs["dtype"]), knobs["draft"],
                       params.temperature, device, gen)
    for fused in (True, False):
        tb.launch(*args, params, 3, fused=fused, options=options)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return f"{shape} compiled"


def precompile(knobs: dict, shapes: list[tuple[int, int, int]], workers: int, seed: int,
               device: torch.device, options: KernelOptions = DEFAULT) -> None:
    """Compile the kernels of all shapes in ``workers`` processes before timing anything."""
    import multiprocessing as mp
    t0 = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        for msg in pool.imap_unordered(_warm_shape, [(knobs, s, seed, device.type,
                                                           options) for s in shapes]):
            print(f"precompile: {msg} at {time.time() - t0:.0f} s", flush=True)


def knobs_of(exp: dict, smoke: bool, device: torch.device) -> dict:
    """Experiment knobs; the smoke shape set when smoke=true or there is no GPU."""
    knobs = dict(exp)
    if smoke or device.type != "cuda":
        knobs.update(knobs.pop("smoke_shapes"))
        knobs.update(compile_ref=False, graph_replays=0, shapes=None)
    return knobs


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise FlashSpecError("hardware.device=cuda but no GPU is visible; use hardware=cpu")
    if name != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")          # before the kernels are defined
        warnings.filterwarnings("ignore", category=RuntimeWarning)   # numpy log(0) = -inf
    return torch.device(name)


def kernel_options(runtime: dict) -> KernelOptions:
    """The runtime config's ``kernels:`` mapping as KernelOptions (``_target_`` dropped: the
    resolved config is a plain mapping here)."""
    spec = dict(runtime.get("kernels") or {})
    spec.pop("_target_", None)
    return KernelOptions(**spec)


def run(cfg: Any) -> dict:
    """Hydra entry: records + figure in cfg.output_dir, W&B through cfg.logger."""
    from experiments.harness import run_dir
    with run_dir(cfg, RECORDS) as run:
        conf = run.config
        device = pick_device(conf["hardware"]["device"])
        knobs = knobs_of(conf["experiment"], bool(conf.get("smoke")), device)
        options = kernel_options(conf["runtime"])
        if int(knobs.get("precompile") or 0) > 0 and device.type == "cuda":
            precompile(knobs, shapes_of(knobs), int(knobs["precompile"]), int(conf["seed"]),
                       device, options)
        summary = bench(knobs, device, float(conf["hardware"]["mem_bandwidth_gbs"]),
                        run.path, conf, int(conf["seed"]), run.logger, options)
    _gate(summary)
    return summary


def _gate(summary: dict) -> None:
    """Fail loudly (after the records are written) if kernel and reference ever disagreed."""
    if not summary["all_identical"]:
        raise AssertionError("kernel and reference outputs differ for some shape (eager or "
                             "graph replay); see 'mismatches' in the records")
