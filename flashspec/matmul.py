"""Few-row products on CPU: ``x Wᵀ`` as given, or computed as ``(W xᵀ)ᵀ``, whichever this
machine runs faster.

On CPU BLAS, ``x @ Wᵀ`` with a handful of rows (the shape of decode and verify steps) may take
a packing, compute-bound path, and a single row a one-thread matrix-vector path, while
``W @ xᵀ`` with at least two columns streams the weight once over all threads. With MKL in
float32 the transposed form wins by a wide margin at decode shapes, while for bfloat16 oneDNN's
own path can win. Which form wins depends on the BLAS, the CPU, the thread count and the exact
number of rows (MKL's float32 ``x Wᵀ`` can be much slower at 3 or 7 rows than at 4 or 8, and
``W xᵀ`` can win at a few rows and lose at a dozen on the same weight), so it is not fixed
here: the first product of each (rows, weight shape, dtype) times both forms for a few
milliseconds and keeps the faster, and the choices are cached per machine in
``<cache_root>/matmul/<machine key>.json`` (CPU model, core and thread count, torch version).

Same math either way (the two forms differ only in summation order, within float rounding).
GPU tensors, autograd and more than ``SMALL_ROWS`` rows always take ``F.linear``. An explicit
choice overrides the measurement: ``linear(..., form="xwt" | "wxt")`` per call, or
``pin_form(form)`` for the whole process.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flashspec.errors import FlashSpecError
from flashspec.paths import cache_root, write_text_atomic

SMALL_ROWS = 16
FORMS = ("xwt", "wxt")       # F.linear as given | (W xᵀ)ᵀ
MEASURE_S = 0.002            # per form, rows and shape, after one warm-up call each

_choices: dict[str, str] | None = None
_pinned: str | None = None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           form: str | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; few-row CPU products take the form this machine runs
    faster (``form`` forces one: 'xwt' or 'wxt')."""
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    if (x.device.type != "cpu" or not 0 < rows <= SMALL_ROWS or x.dtype != weight.dtype
            or not weight.dtype.is_floating_point or weight.dim() != 2
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    form = form or _pinned or choose_form(rows, weight)
    if form == "xwt":
        return F.linear(x, weight, bias)
    if form != "wxt":
        raise FlashSpecError(f"matmul form {form!r}; choose one of {', '.join(FORMS)}")
    y = _wxt(x.reshape(rows, width), weight, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _wxt(flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
         ) -> torch.Tensor:
    # row-major rows, so that cols.T is the column-major operand BLAS streams W against (a
    # transposed input, e.g. an elementwise product of two earlier outputs, takes a much slower path)
    rows = flat.shape[0]
    flat = flat.contiguous()
    cols = flat.repeat(2, 1) if rows == 1 else flat  # a contiguous second column, not a view
    # the bias joins inside addmm: one rounding, as in F.linear (an add after a bf16 mm rounds twice)
    y = torch.mm(weight, cols.T) if bias is None else torch.addmm(bias[:, None], weight, cols.T)
    return y.T[:rows].contiguous()


def pin_form(form: str | None) -> None:
    """Use ``form`` for every few-row CPU product of this process (None: measured choice)."""
    global _pinned
    if form is not None and form not in FORMS:
        raise FlashSpecError(f"matmul form {form!r}; choose one of {', '.join(FORMS)} or None")
    _pinned = form


def shape_key(rows: int, weight: torch.Tensor) -> str:
    out_f, in_f = weight.shape
    return f"{str(weight.dtype).removeprefix('torch.')}:r{rows}:{out_f}x{in_f}"


def choose_form(rows: int, weight: torch.Tensor, refresh: bool = False) -> str:
    """The faster form for ``rows`` rows against ``weight`` on this machine: cached in memory
    and on disk, measured (a few ms) the first time or when ``refresh``."""
    choices = _load()
    key = shape_key(rows, weight)
    if refresh or key not in choices:
        if torch.compiler.is_compiling():     # no timing inside a trace: the plain form
            return "xwt"
        choices[key] = measure(rows, weight)
        _save(key, choices[key])
    return choices[key]


@torch.no_grad()
def measure(rows: int, weight: torch.Tensor, budget_s: float = MEASURE_S) -> str:
    """Time both forms on a random ``rows`` x d input (interleaved, best of each) -> faster."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    runs = {"xwt": lambda: F.linear(x, weight), "wxt": lambda: _wxt(x, weight)}
    best = {}
    for name, fn in runs.items():
        t0 = time.perf_counter()
        fn()                                   # warm-up (packing, thread pool)
        best[name] = time.perf_counter() - t0
    reps = max(3, min(50, int(budget_s / max(min(best.values()), 1e-7))))
    for _ in range(reps):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return min(FORMS, key=lambda name: best[name])


def machine_key() -> dict[str, object]:
    """What a measured choice holds for: CPU model, cores, torch threads, torch version."""
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "machine": platform.machine()}


def cache_file() -> Path:
    key = json.dumps(machine_key(), sort_keys=True)
    return cache_root() / "matmul" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _load() -> dict[str, str]:
    global _choices
    if _choices is None:
        _choices = {}
        try:
            blob = json.loads(cache_file().read_text())
            _choices = {k: v for k, v in blob["choices"].items() if v in FORMS}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass                               # no cache yet, or a damaged one: measure again
    return _choices


def _save(key: str, form: str) -> None:
    """Merge one choice into the machine's file (other processes may have added theirs)."""
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            on_disk = json.loads(path.read_text())["choices"]
        except (OSError, ValueError, KeyError, TypeError):
            on_disk = {}
        on_disk[key] = form
        write_text_atomic(path, json.dumps({"machine": machine_key(), "choices": on_disk},
                                           indent=1, sort_keys=True) + "\n")
    except OSError:
        pass                                   # read-only cache: the in-memory choice stands
