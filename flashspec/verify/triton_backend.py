"""Fused Triton backend of exact speculative verification.

``verify`` has the reference's contract (flashspec.verify.reference.verify) and draws the same
counter-based random numbers, so both return the same tokens and counts for the same seed
(up to float rounding of the log-sum-exp, which can only matter when a log-space accept test
or the race is decided by less than ~1e-6). No host synchronisation happens inside on CUDA:
the seed may be a device int64 scalar, and invalid input cannot raise there. Instead a row
whose logits hold NaN or +inf (or are all -inf, or overflow when divided by T), whose
temperature is negative, or whose draft token is outside [0, V) is *poisoned*:
n_accepted = -1 and every output token -1; the engine checks ``n_accepted.min() < 0`` when
it reads the counts anyway. On CPU tensors (TRITON_INTERPRET=1) poisoned rows raise
FloatingPointError like the reference.

What is not fused falls back to the reference with a logged reason (once per reason):
top-p < 1, top-k > 256, top-k on CUDA (unless KernelOptions.fuse_topk_on_cuda), dtypes other than
bf16/fp16/fp32, V >= 2^24, γ >= 65,535 (the positions' grid axis), CPU tensors without Triton's
interpreter (flashspec.options.interpreted); the rule is the ``verify`` op's of
:mod:`flashspec.kernels`.

Every switch comes in as a :class:`flashspec.options.KernelOptions` argument (``options=``);
the module holds no switches of its own.

Host cost per call is kept small: the plan, workspace and merge counters are cached per shape
(one output allocation per call), kernels take few arguments (unit inner strides; chunk counts
derived in the kernels; int and device seeds share one compiled variant), and with
``KernelOptions(direct_launch=True)`` the cached compiled kernels are launched without Triton's binder.
Concurrent calls of one shape on different CUDA streams are not supported (they would share
the cached workspace and counters).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from flashspec.core import SamplingParams
from flashspec.kernels import DTYPES, choose
from flashspec.options import DEFAULT, KernelOptions, interpreted
from flashspec.verify import reference
from flashspec.verify.api import Backend
from flashspec.verify.checks import check_shapes
from flashspec.verify import triton_kernels as K
from flashspec.verify import triton_tree
from flashspec.verify.triton_host import log_once, next_pow2, seed_args, unit_rows

INTERPRET = interpreted(K.stats_kernel)     # how the kernels were built (not a switch)
FUSE_MAX_BATCH = 8      # default plan: fused merges up to this batch (launch-bound), else separate


@dataclass(frozen=True)
class Plan:
    """Launch geometry of one call."""

    rows: int           # batch rows per program (1 on the GPU)
    chunk: int          # vocabulary elements per pass-1 program (loaded as one tile)
    rchunk: int         # vocabulary elements per pass-2 program (RACE_BLOCK x a power of 2)
    warps: int
    rwarps: int
    fused: bool | None = None   # merge choice of this plan (options.fuse_merges or the call
                                # override it)


@dataclass
class _Slot:
    """Per-shape state reused across calls: geometry, workspace, counters, the launches
    (kernel, grid, constexprs, warps) and, with direct launch, their compiled kernels."""

    plan: Plan
    fused: bool
    nc: int
    ncr: int
    ws: torch.Tensor
    cnt: torch.Tensor
    launches: list = field(default_factory=list)
    compiled: dict = field(default_factory=dict)


_SLOTS: dict[tuple, _Slot] = {}


def _bucket(n: int) -> int:
    """Padded chunk count of the merge loads: few distinct values, so few compilations."""
    return next_pow2(n) if INTERPRET else max(64, next_pow2(n))


def plan(batch: int, gamma: int, vocab: int, interpret: bool = INTERPRET,
         n_sm: int = 132) -> Plan:
    """Chunking. GPU: pass-1 chunks as large as still give ~8 programs per SM, each loaded as
    one tile (all its loads in flight at once) and reduced directly, pass-2 chunks (whole
    race blocks) likewise; fused merges only at small batch. Interpreter: few, big programs."""
    rb = reference.RACE_BLOCK
    if interpret:
        chunk = min(next_pow2(vocab), 32768)
        rows = max(1, min(next_pow2(batch), (1 << 20) // max(chunk, rb)))
        return Plan(rows, chunk, max(chunk, rb), 4, 4)
    chunk = _chunk(batch * (gamma + 1), vocab, (8192, 4096, 2048), 1024, 8 * n_sm)
    rchunk = _chunk(batch, vocab, (8192, 4096, 2048), rb, 8 * n_sm)
    return Plan(1, chunk, rchunk, 4, 4, fused=batch <= FUSE_MAX_BATCH)


def _chunk(rows: int, vocab: int, sizes: tuple[int, ...], smallest: int, programs: int) -> int:
    """The largest chunk size that still gives ``programs`` programs over ``rows`` rows."""
    return next((c for c in sizes if rows * math.ceil(vocab / c) >= programs), smallest)


def verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
           draft_logits: torch.Tensor | None, params: SamplingParams,
           seed: int | torch.Tensor = 0, temperature: torch.Tensor | None = None,
           options: KernelOptions = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused verification: (out_tokens [B, γ+1] int64 padded with -1, n_accepted [B] int64).
    Shapes are checked here (host metadata only), values are not (flashspec.verify.checks)."""
    check_shapes(target_logits, draft_tokens, draft_logits)
    choice = choose("verify", target_logits, options, draft_logits=draft_logits, params=params)
    if not choice.triton:
        log_once(choice.reason)
        return reference.verify(target_logits, draft_tokens, draft_logits, params, seed,
                                temperature=temperature)
    out, nacc = launch(target_logits, draft_tokens, draft_logits, params, seed, temperature,
                       options=options)
    if target_logits.device.type == "cpu" and bool((nacc < 0).any()):
        raise FloatingPointError("logits contain NaN or +inf (or a row is all -inf), a "
                                 "temperature is negative or a draft token is out of range")
    return out, nacc


def make_backend(options: KernelOptions = DEFAULT) -> Backend:
    """The ``triton`` backend with ``options``. Graph safe without top-k/top-p (no host sync on
    CUDA); warped calls may fall back to the reference, so those are not."""
    return Backend("triton", functools.partial(verify, options=options), graph_safe=True,
                   graph_safe_warps=False, dtypes=DTYPES, verify_tree=triton_tree.verify_tree)


def _resolve_fused(fused: bool | None, p: Plan, options: KernelOptions = DEFAULT) -> bool:
    """The call's choice, else options.fuse_merges, else the plan's, else fused."""
    for choice in (fused, options.fuse_merges, p.fused):
        if choice is not None:
            return choice
    return True


def _workspace_size(batch: int, gamma: int, nc: int, nb: int, nct: int, kp2: int) -> int:
    """Float32 elements of the workspace (see triton_kernels._layout)."""
    rows_pq = batch * (gamma + 1) + batch * gamma
    return rows_pq * (3 * nc + 1) + batch * (int(K.N_ROWSTAT.value) + 2 * nb) + rows_pq * nct * kp2


def _slot(key: tuple, p: Plan, fused: bool, batch: int, gamma: int, vocab: int, top_k: int,
          flags: dict, device: torch.device, fuse_finish: bool) -> _Slot:
    """Build the per-shape state. Workspaces are never evicted: a captured CUDA graph keeps
    pointing at them. A shape first seen during graph capture gets uncached buffers (zeroed
    inside the graph), since eager calls could not rely on counters that were never zeroed."""
    blocks = p.rchunk // reference.RACE_BLOCK
    if p.rchunk % reference.RACE_BLOCK or blocks & (blocks - 1):
        raise ValueError(f"rchunk {p.rchunk} is not a power-of-two multiple of "
                         f"{reference.RACE_BLOCK}")
    nc, ncr = -(-vocab // p.chunk), -(-vocab // p.rchunk)
    nb = -(-vocab // reference.RACE_BLOCK)
    kp2 = next_pow2(top_k) if top_k else 1
    nct = -(-vocab // max(p.chunk, kp2)) if top_k else 0
    n_groups = -(-batch // p.rows)
    ws = torch.empty(_workspace_size(batch, gamma, nc, nb, nct, kp2), dtype=torch.float32,
                     device=device)
    cnt = torch.zeros(2 * n_groups, dtype=torch.int32, device=device)
    slot = _Slot(p, fused, nc, ncr, ws, cnt)
    common = dict(G=gamma, ROWS=p.rows, CHUNK=p.chunk)
    fuse_finish = fused or fuse_finish
    # row groups share grid axis 0 with the chunks (triton_kernels docstring: any batch fits)
    slot.launches.append(("stats", K.stats_kernel, (nc * n_groups, gamma + 1, 1), dict(
        common, NC_P2=_bucket(nc), G_P2=next_pow2(gamma + 1),
        **flags, FUSED=fused, INTERPRET=INTERPRET), p.warps))
    if not fused:
        slot.launches.append(("decide", K.decide_kernel, (n_groups, 1, 1), dict(
            common, NC_P2=_bucket(nc), G_P2=next_pow2(gamma + 1), **flags,
            INTERPRET=INTERPRET), 4))
    slot.launches.append(("race", K.race_kernel, (ncr * n_groups, 1, 1), dict(
        common, RCHUNK=p.rchunk, NB_P2=_bucket(nb), **flags, FUSED=fuse_finish,
        INTERPRET=INTERPRET), p.rwarps))
    if not fuse_finish:
        slot.launches.append(("finish", K.finish_kernel, (n_groups, 1, 1), dict(
            common, NB_P2=_bucket(nb), **flags, INTERPRET=INTERPRET), 4))
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _SLOTS[key] = slot
    return slot


def _run(fn, slot: _Slot, name: str, grid: tuple[int, int, int], args: tuple, consts: dict,
         warps: int, stream) -> None:
    """Launch ``fn``: through the cached compiled kernel when there is one, else through
    Triton, caching the compiled kernel it returns when launching directly (``stream`` given)."""
    ck = slot.compiled.get(name)
    if ck is not None:
        ck[grid](*args, *consts.values(), stream=stream)
        return
    ck = fn[grid](*args, **consts, num_warps=warps)
    if (stream is not None and hasattr(ck, "function")
            and list(fn.arg_names) == list(fn.arg_names[:len(args)]) + list(consts)):
        slot.compiled[name] = ck


def _stream(device: torch.device) -> int:
    """Raw handle of the current CUDA stream (what Triton's launcher takes)."""
    from triton.runtime import driver
    return driver.active.get_current_stream(device.index)


def _aligned(*ts: torch.Tensor) -> bool:
    """All data pointers 16-byte aligned (what Triton specialises kernels on)."""
    acc = 0
    for t in ts:
        acc |= t.data_ptr()
    return acc & 15 == 0


def launch(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
           draft_logits: torch.Tensor | None, params: SamplingParams,
           seed: int | torch.Tensor = 0, temperature: torch.Tensor | None = None,
           fused: bool | None = None, geometry: Plan | None = None,
           options: KernelOptions = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernels (no fallback, no host sync); poisoned rows have n_accepted = -1.
    ``fused`` overrides ``options.fuse_merges``; ``geometry`` the default :func:`plan`."""
    batch, gamma = draft_tokens.shape
    vocab = target_logits.shape[-1]
    device = target_logits.device
    buf = torch.empty(batch * (gamma + 2), dtype=torch.int64, device=device)
    out, nacc = buf[:batch * (gamma + 1)].view(batch, gamma + 1), buf[batch * (gamma + 1):]
    if batch == 0:
        return out, nacc
    tgt = unit_rows(target_logits)
    has_q = draft_logits is not None
    drf = unit_rows(draft_logits) if has_q else tgt
    tok = draft_tokens if draft_tokens.is_contiguous() else draft_tokens.contiguous()
    temp_ptr, temp = tgt, float(params.temperature)
    if temperature is not None:
        temp_ptr = temperature.reshape(batch).contiguous()
        if temp_ptr.device != device:
            temp_ptr = temp_ptr.to(device)
    seed_ptr, seed_i, seed_mode = seed_args(seed, device)
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    direct = (options.direct_launch and not INTERPRET and device.type == "cuda"
              and _aligned(tgt, drf, tok, temp_ptr, seed_ptr))
    t_sb, d_sb = tgt.stride(0), drf.stride(0)
    key = (device, batch, gamma, vocab, tgt.dtype, drf.dtype, t_sb, d_sb, tok.dtype, has_q,
           top_k, temp_ptr.dtype if temperature is not None else None, fused, options, geometry,
           direct)
    slot = _SLOTS.get(key)
    if slot is None:
        p = geometry or plan(batch, gamma, vocab)
        fused = _resolve_fused(fused, p, options)
        flags = dict(HAS_Q=has_q, TOPK=top_k > 0, ROW_TEMP=temperature is not None)
        slot = _slot(key, p, fused, batch, gamma, vocab, top_k, flags, device, options.fuse_finish)
    if top_k:
        _launch_topk(slot.plan, tgt, drf, has_q, temp_ptr, temp, slot.ws, batch, gamma, vocab,
                     slot.nc, top_k, temperature is not None)
    args = (tgt, t_sb, drf, d_sb, tok, temp_ptr, temp, seed_ptr, seed_i, seed_mode, slot.ws)
    tail = (buf, batch, vocab)
    stream = _stream(device) if direct else None
    for name, fn, grid, consts, warps in slot.launches:
        _run(fn, slot, name, grid, launch_args(slot, name, args, tail), consts, warps, stream)
    return out, nacc


def launch_args(slot: _Slot, name: str, args: tuple, tail: tuple) -> tuple:
    """Positional arguments of the launch ``name`` of ``slot``: the common inputs ``args``
    (logits .. workspace), the merge counters where the kernel takes them, then ``tail``
    (output buffer, B, V)."""
    return args + tail if name in ("decide", "finish") else args + (slot.cnt,) + tail


def _launch_topk(p: Plan, tgt: torch.Tensor, drf: torch.Tensor, has_q: bool, temp_ptr, temp,
                 ws: torch.Tensor, batch: int, gamma: int, vocab: int, nc: int, k: int,
                 row_temp: bool) -> None:
    """Top-k thresholds (k-th largest of x/T) of every target and draft row-position."""
    kp2 = next_pow2(k)
    block = max(p.chunk, kp2)
    nct = -(-vocab // block)
    nt_p2 = next_pow2(nct * kp2)
    rows = p.rows if INTERPRET else 1
    for is_q, src, npos in ((False, tgt, gamma + 1), (True, drf, gamma)):
        if is_q and not has_q:
            continue
        groups = -(-batch * npos // rows)
        K.topk_cand_kernel[(nct * groups,)](
            src, src.stride(0), src.stride(1), temp_ptr, temp, ws, batch, vocab, nc, nct,
            G=gamma, IS_Q=is_q, KP2=kp2, BLOCK=block, ROWS=rows, ROW_TEMP=row_temp,
            num_warps=8)
        K.topk_thr_kernel[(groups,)](ws, batch, vocab, nc, nct, k, G=gamma, IS_Q=is_q, KP2=kp2,
                                     NT_P2=nt_p2, ROWS=rows, num_warps=8)
