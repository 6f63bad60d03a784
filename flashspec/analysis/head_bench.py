"""Head latency benchmark: ν = latency(variant) / latency(full), measured side by side.

For each shape (d, V) and batch B, the full head, low-rank heads at r = d/N and truncated
heads with the same weight bytes as each low-rank head (k = r (V + d) / d) are timed in
interleaved rounds in one process (each round times every variant once, in a shuffled
order), after warm-up, cycling through enough weight copies that the working set exceeds
the last-level cache. CPU: perf_counter; CUDA: torch.cuda.Event pairs.

``lowrank_d/N`` runs both projections through F.linear (cuBLAS on CUDA);
``lowrank_triton_d/N`` (CUDA, B <= 16) runs the up projection through the Triton kernel of
:mod:`flashspec.heads.triton_head` (the down projection stays F.linear).

Run it as ``python run.py experiment=head_bench`` (experiments/head_bench.py maps the config
onto :class:`BenchConfig`).
"""
from __future__ import annotations

import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from flashspec.heads.modules import FullHead, LowRankHead, TruncatedHead
from flashspec.kernels import HEAD_MAX_ROWS as TRITON_MAX_ROWS
from flashspec.theory import equal_cost_keep, lowrank_cost_ratio

SHAPES = ((576, 49152), (2048, 32000), (4096, 128256), (3584, 152064))
SHAPE_NAMES = {(576, 49152): "smollm2-135m", (2048, 32000): "tinyllama-1.1b",
               (4096, 128256): "llama-3.1-8b", (3584, 152064): "qwen2.5-7b"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BenchConfig:
    """Knobs of one benchmark run (plain data: the Hydra config maps onto it)."""

    shapes: list[tuple[int, int]] = field(default_factory=lambda: [tuple(s) for s in SHAPES])
    batches: list[int] = field(default_factory=lambda: [1, 64])
    rank_divs: list[int] = field(default_factory=lambda: [4, 8, 16, 32])
    device: str = "cpu"
    dtype: str | None = None          # None: float32 on CPU, bfloat16 on CUDA
    warmup: int = 3                   # untimed rounds first
    min_rounds: int = 7
    max_rounds: int = 200
    budget_s: float = 20.0            # timed seconds per (shape, B), rounds permitting
    min_sample_s: float = 2e-4        # one sample repeats a call until it lasts this long
    flush_factor: float = 2.0         # copies so that the weights exceed this x last-level cache
    max_copies: int = 64
    truncated_kept: bool = True       # also time the k-logit output (no -inf fill)
    threads: int | None = None        # CPU intra-op threads (None: torch's default)
    layout: str = "out_in"            # weight storage of every head: out_in (nn.Linear) | in_out
    cuda_graphs: bool = False         # CUDA: time graph replays (device time, no launch gaps)
    triton: bool = True               # CUDA, B <= 16: also time lowrank_triton_d/N
    seed: int = 0

    def resolved_dtype(self) -> str:
        return self.dtype or ("bfloat16" if self.device.startswith("cuda") else "float32")

    def triton_at(self, batch: int) -> bool:
        """Whether the Triton low-rank variants are timed at this batch size."""
        return self.triton and self.device.startswith("cuda") and batch <= TRITON_MAX_ROWS

    @classmethod
    def smoke(cls, device: str = "cpu", dtype: str | None = None) -> "BenchConfig":
        """A few seconds: the smallest real shape, B=1, one rank."""
        return cls(shapes=[(576, 49152)], batches=[1], rank_divs=[8], device=device, dtype=dtype,
                   warmup=1,
                   min_rounds=3, max_rounds=5, budget_s=0.5, truncated_kept=False)


@dataclass
class Variant:
    """One head kind at one size, with its rotated weight copies."""

    name: str
    kind: str
    rank: int | None
    keep: int | None
    rank_div: int | None
    copies: list[Callable[[torch.Tensor], torch.Tensor]]
    weight_bytes: int
    flops_per_token: int
    calls: int = 0                    # rotation counter: call i uses copy i mod len(copies)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.copies[self.calls % len(self.copies)](x)
        self.calls += 1
        return out


def last_level_cache_bytes(device: str) -> int:
    """L2 of the GPU, or the largest CPU cache level Linux reports (32 MiB if unknown)."""
    if device.startswith("cuda"):
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * mult)
    return max(sizes, default=32 << 20)


def n_copies(weight_bytes: int, flush_bytes: int, cap: int) -> int:
    return max(1, min(cap, math.ceil(flush_bytes / max(1, weight_bytes))))


def _lowrank(w_down: torch.Tensor, w_up: torch.Tensor, layout: str, use_triton: bool
             ) -> LowRankHead:
    return LowRankHead(w_down, w_up, layout, use_triton)


def _variants(d: int, vocab: int, cfg: BenchConfig, dtype: torch.dtype, flush: int,
              gen: torch.Generator, triton: bool = False) -> list[Variant]:
    """Full, low-rank (r = d/N; with ``triton`` also its Triton up projection) and equal-cost
    truncated heads with random weights."""
    dev = cfg.device
    full_w = (torch.randn(vocab, d, generator=gen) * 0.02).to(dev, dtype)

    def make(name, kind, rank, keep, div, factory) -> Variant:
        first = factory()
        copies = [first] + [factory() for _ in range(n_copies(first.weight_bytes(), flush,
                                                               cfg.max_copies) - 1)]
        fns = [c.forward_kept if name.endswith("_kept") else c for c in copies]
        return Variant(name, kind, rank, keep, div, fns, first.weight_bytes(),
                       first.flops_per_token())

    made = [0]

    def full_copy() -> FullHead:  # the first copy is full_w itself, later ones are clones
        made[0] += 1
        return FullHead(full_w if made[0] == 1 else full_w.clone(), cfg.layout)

    out = [make("full", "full", None, None, None, full_copy)]
    for div in cfg.rank_divs:
        r = max(1, d // div)
        k = equal_cost_keep(r, vocab, d)
        for name, kind, tri in ((f"lowrank_d/{div}", "lowrank", False),
                                (f"lowrank_triton_d/{div}", "lowrank_triton", True)):
            if tri and not triton:
                continue
            out.append(make(name, kind, r, None, div, lambda tri=tri: _lowrank(
                (torch.randn(r, d, generator=gen) * 0.05).to(dev, dtype),
                (torch.randn(vocab, r, generator=gen) * 0.05).to(dev, dtype), cfg.layout, tri)))
        ids = torch.randperm(vocab, generator=gen)[:k].sort().values
        out.append(make(f"truncated_d/{div}", "truncated", None, k, div,
                        lambda: TruncatedHead(full_w, ids, vocab, layout=cfg.layout)))
        if cfg.truncated_kept:
            out.append(make(f"truncated_d/{div}_kept", "truncated_kept", None, k, div,
                            lambda: TruncatedHead(full_w, ids, vocab, layout=cfg.layout)))
    return out


class Timer:
    """Elapsed seconds of ``fn()``: perf_counter on CPU, CUDA events on GPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def _sample(v: Variant, x: torch.Tensor, inner: int, timer: Timer) -> float:
    """Per-call seconds of ``inner`` consecutive calls, each on the variant's next weight copy."""
    def body() -> None:
        for _ in range(inner):
            v(x)
    return timer(body) / inner


GRAPH_MIN_CALLS = 16   # calls per captured graph at least: its launch is then a small share


def graph_calls(inner: int, copies: int) -> int:
    """Calls in one captured graph: at least ``GRAPH_MIN_CALLS`` (a graph of one fast call
    times the graph's own launch with it) and a whole number of rounds over the weight copies
    (the rotation is fixed at capture: a graph of fewer calls than copies re-reads the same,
    partly cached, weights on every replay)."""
    n = max(inner, GRAPH_MIN_CALLS, copies)
    return copies * -(-n // copies)


def _capture(v: Variant, x: torch.Tensor, inner: int) -> Callable[[], Any]:
    """A CUDA graph of ``inner`` rotated calls of ``v``; returns its replay.

    Eager timing of small heads on a GPU measures kernel-launch gaps (the GPU idles between
    launches); a captured decode step has none, so replays time the device work alone.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
        for _ in range(2):
            v(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            v(x)
    return graph.replay


def bench_shape(d: int, vocab: int, batch: int, cfg: BenchConfig, progress: bool = True
                ) -> list[dict[str, Any]]:
    """Records (one per variant) for one shape and batch size."""
    if cfg.cuda_graphs and not cfg.device.startswith("cuda"):
        raise ValueError("cuda_graphs=True needs device=cuda")
    dtype = DTYPES[cfg.resolved_dtype()]
    gen = torch.Generator().manual_seed(cfg.seed)
    flush = int(cfg.flush_factor * last_level_cache_bytes(cfg.device))
    variants = _variants(d, vocab, cfg, dtype, flush, gen, cfg.triton_at(batch))
    x = torch.randn(batch, d, generator=gen).to(cfg.device, dtype)
    timer = Timer(cfg.device)
    with torch.inference_mode():
        inner = {}
        for v in variants:  # warm-up, and calls per sample so a sample lasts min_sample_s
            once = min(_sample(v, x, 1, timer) for _ in range(max(1, cfg.warmup)))
            inner[v.name] = max(1, min(64, math.ceil(cfg.min_sample_s / max(once, 1e-9))))
        if cfg.cuda_graphs:
            inner = {v.name: graph_calls(inner[v.name], len(v.copies)) for v in variants}
            replays = {v.name: _capture(v, x, inner[v.name]) for v in variants}
            sample = lambda v: timer(replays[v.name]) / inner[v.name]  # noqa: E731
        else:
            sample = lambda v: _sample(v, x, inner[v.name], timer)  # noqa: E731
        times: dict[str, list[float]] = {v.name: [] for v in variants}
        order = list(range(len(variants)))
        rng = random.Random(cfg.seed)
        spent, rounds = 0.0, 0
        t_start = time.perf_counter()
        while rounds < cfg.max_rounds and (rounds < cfg.min_rounds or spent < cfg.budget_s):
            rng.shuffle(order)
            for i in order:
                v = variants[i]
                times[v.name].append(sample(v))
            rounds += 1
            spent = time.perf_counter() - t_start
            if progress:
                print(f"\r  d={d} V={vocab} B={batch}: round {rounds} ({spent:.1f}s)", end="",
                      file=sys.stderr)
    if progress:
        print(file=sys.stderr)
    return _records(d, vocab, batch, cfg, variants, times, inner, flush)


def _records(d: int, vocab: int, batch: int, cfg: BenchConfig, variants: list[Variant],
             times: dict[str, list[float]], inner: dict[str, int], flush: int
             ) -> list[dict[str, Any]]:
    full = times["full"]
    full_med = statistics.median(full)
    out = []
    for v in variants:
        t = times[v.name]
        paired = sorted(a / b for a, b in zip(t, full))
        q = _quantiles(sorted(t))
        out.append({
            "shape": SHAPE_NAMES.get((d, vocab), f"d{d}_V{vocab}"), "hidden_size": d,
            "vocab_size": vocab, "batch": batch, "variant": v.name, "kind": v.kind,
            "rank": v.rank, "rank_div": v.rank_div, "keep": v.keep,
            "keep_fraction": None if v.keep is None else v.keep / vocab,
            "weight_bytes": v.weight_bytes, "flops_per_token": v.flops_per_token,
            "cost_ratio": v.weight_bytes / variants[0].weight_bytes,
            "ideal_nu": None if v.rank is None else lowrank_cost_ratio(v.rank, vocab, d),
            "latency_us": q[1] * 1e6, "latency_us_p10": q[0] * 1e6, "latency_us_p90": q[2] * 1e6,
            "n_samples": len(t), "calls_per_sample": inner[v.name], "copies": len(v.copies),
            "flush_bytes": flush, "nu": statistics.median(t) / full_med,
            "nu_paired": statistics.median(paired), "nu_paired_p25": _q(paired, 0.25),
            "nu_paired_p75": _q(paired, 0.75), "device": cfg.device,
            "dtype": cfg.resolved_dtype(), "layout": cfg.layout, "cuda_graphs": cfg.cuda_graphs,
            "threads": None if cfg.device.startswith("cuda")
            else torch.get_num_threads(), "loadavg_1m": _loadavg(),
        })
    return out


def _loadavg() -> float | None:
    """1-minute load average (other processes sharing a CPU distort timings)."""
    try:
        import os
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def _q(sorted_values: Sequence[float], p: float) -> float:
    i = p * (len(sorted_values) - 1)
    lo, hi = math.floor(i), math.ceil(i)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (i - lo)


def _quantiles(sorted_values: Sequence[float]) -> tuple[float, float, float]:
    return _q(sorted_values, 0.1), _q(sorted_values, 0.5), _q(sorted_values, 0.9)


def run_bench(cfg: BenchConfig, out_dir: str | Path, config: dict | None = None,
              logger: Any = None, progress: bool = True) -> dict[str, Any]:
    """Run every (shape, B); write ``head_bench.jsonl`` (+ provenance) and ``nu_vs_rank.png``."""
    from flashspec.records import RecordWriter, provenance
    if cfg.threads and not cfg.device.startswith("cuda"):
        torch.set_num_threads(cfg.threads)
    out = Path(out_dir)
    writer = RecordWriter(out / "head_bench.jsonl")
    prov = provenance(config or asdict(cfg), cfg.seed)
    records: list[dict[str, Any]] = []
    for d, vocab in cfg.shapes:
        for batch in cfg.batches:
            for rec in bench_shape(d, vocab, batch, cfg, progress):
                rec = {"experiment": "head_bench", **rec, "provenance": prov}
                writer.write(rec)
                records.append(rec)
                if logger is not None:
                    logger.log({f"{rec['shape']}/B{batch}/{rec['variant']}/nu": rec["nu"]})
            if torch.cuda.is_available() and cfg.device.startswith("cuda"):
                torch.cuda.empty_cache()
    figure = plot_nu(records, out / "nu_vs_rank.png")
    if logger is not None:
        logger.table("head_bench", [{k: v for k, v in r.items() if k != "provenance"}
                                    for r in records])
    return {"records": str(writer.path), "figure": str(figure) if figure else None,
            "n_records": len(records)}


def plot_nu(records: Iterable[dict[str, Any]], path: str | Path) -> Path | None:
    """ν vs rank, one panel per shape; truncation plotted at the rank of equal cost."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = list(records)
    shapes = list(dict.fromkeys(r["shape"] for r in records))
    fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 3.4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        rows = [r for r in records if r["shape"] == shape and r["rank_div"]]
        d = rows[0]["hidden_size"] if rows else 1
        for (kind, batch), style in _series(rows).items():
            pts = sorted((d // r["rank_div"], r["nu"]) for r in rows
                         if r["kind"] == kind and r["batch"] == batch)
            ax.plot(*zip(*pts), style, label=f"{kind} B={batch}")
        ideal = sorted({(r["rank"], r["ideal_nu"]) for r in rows if r["ideal_nu"]})
        if ideal:
            ax.plot(*zip(*ideal), "k:", label="bytes ratio r(V+d)/(Vd)")
        layouts = "/".join(sorted({str(r.get("layout", "out_in")) for r in rows}))
        ax.set(xscale="log", yscale="log", title=f"{shape} ({layouts})", xlabel="rank r (truncation: equal-cost k)",
               ylabel="ν = latency / full-head latency")
        ranks = sorted({d // r["rank_div"] for r in rows})
        ax.set_xticks(ranks, [str(r) for r in ranks])
        ax.minorticks_off()
        ax.axhline(1.0, color="grey", lw=0.5)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _series(rows: list[dict[str, Any]]) -> dict[tuple[str, int], str]:
    """Matplotlib format per (kind, batch): colour by kind, line style by batch."""
    colors = {"lowrank": "C0", "truncated": "C1", "truncated_kept": "C2", "lowrank_triton": "C3"}
    styles = ["o-", "s--", "^-.", "v:"]
    batches = sorted({r["batch"] for r in rows})
    present = {(r["kind"], r["batch"]) for r in rows}
    return {(k, b): colors[k] + styles[i % len(styles)] for k in colors
            for i, b in enumerate(batches) if (k, b) in present}
