"""Fused Triton tree verification (contract: :func:`flashspec.verify.tree.verify_tree`).

Two kernels, the same counter-based random numbers as the reference, so both backends return
the same tokens for the same seed (up to float rounding of the log-sum-exp and of the residual
masses, which can only matter when a log-space test or a race is decided by ~1e-6):

1. ``tree_stats_kernel``: per (row, node) of the target logits (and of the draft logits when
   siblings were sampled) one streaming pass over V: max/T, log Σ exp, the first argmax and a
   poison flag (NaN/+inf, a row of only -inf, x/T overflowing). Every node in parallel, and on
   a GPU each node's vocabulary in STAT_SPLITS programs, which ``tree_stats_merge_kernel``
   combines (a lone vocabulary-wide row streamed by one program is latency bound).
2. ``tree_walk_kernel``: per row group, the walk down the tree of the recursive rejection rule.
   At a node its children are tested in sibling order; the residual after rejected siblings
   is never materialised: it is a function of p(v), q(v) and, per rejected sibling j, the
   token x_j and the masses S_j = Σ w_j, Q_j = Σ q_j, re-applied per element wherever the
   residual is read (one-hot drafts: x_j zeroed, S_{j+1} = S_j - w_j(x_j); sampled siblings:
   w_{j+1} = max(0, w_j/S_j - q_j/Q_j), x_j leaves q, S_{j+1} one streaming pass). When every
   child is rejected (or at a leaf) the correction/bonus token is drawn by the reference's
   two-level race (block masses, then a token of the winning block), streamed block by block.
   On-chip memory is O(1) in V: every pass streams the vocabulary in tiles.

Fused: temperature (per row or scalar), greedy rows, one-hot and sampled siblings, bf16/fp16/
fp32 logits. Top-k/top-p warps, other dtypes and CPU tensors without Triton's interpreter fall
back to the reference with a logged reason. No host synchronisation on CUDA: invalid rows
(NaN/+inf logits, negative temperature, a token outside [0, V)) are poisoned (n_accepted = -1,
every token -1); on CPU tensors they raise FloatingPointError like the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashspec.core import SamplingParams, TreeDraft
from flashspec.kernels import choose
from flashspec.options import DEFAULT, KernelOptions, interpreted
from flashspec.verify import tree as reference_tree
from flashspec.verify.checks import check_tree_shapes
from flashspec.verify.triton_host import log_once, next_pow2, seed_args, unit_rows
from flashspec.verify.triton_kernels import (BIG_IDX, FLT_MAX, NEG_INF, POS_INF, RBLK, _exp,
                                             _load_seed_rt, _log, _row_temps, _stream_key,
                                             _uniform)

N_STAT = 4          # Mz, log S, argmax, poisoned per (row, node) in the workspace
STAT_SPLITS = 12    # programs per (row, node) of the statistics pass on a GPU


@triton.jit
def tree_stats_kernel(src, s_sb, temp_ptr, temp, part, B, W, V, span,
                      ROWS: tl.constexpr, CHUNK: tl.constexpr, ROW_TEMP: tl.constexpr):
    """Partial statistics of rows r = b * W + i of ``src`` [B, W, V] (batch stride s_sb, node
    stride V) over the columns of split s = program_id(1) (``span`` wide), stored at
    part[(r * splits + s) * N_STAT + 0..3]: max, Σ exp((x - max)/T), first argmax, NaN/+inf
    seen (1.0)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    split = tl.program_id(1)
    rm = r < B * W
    b = r // W
    scale, c2, greedy, badt = _row_temps(temp_ptr, temp, b, rm, ROW_TEMP)
    ptr = src + b.to(tl.int64) * s_sb + (r % W).to(tl.int64) * V
    m = tl.full([ROWS], NEG_INF, tl.float32)
    s = tl.zeros([ROWS], tl.float32)
    am = tl.full([ROWS], BIG_IDX, tl.int32)
    bad = tl.zeros([ROWS], tl.int1)
    lo = split * span
    for v0 in range(lo, lo + span, CHUNK):
        offs = v0 + tl.arange(0, CHUNK)[None, :]
        x = tl.load(ptr[:, None] + offs, mask=rm[:, None] & (offs < V), other=NEG_INF)
        x = x.to(tl.float32)
        bad = bad | (tl.max(((x != x) | (x == POS_INF)).to(tl.int32), 1) > 0)
        x = tl.where(x == x, x, NEG_INF)
        cm = tl.max(x, 1)
        ca = tl.min(tl.where(x == cm[:, None], offs, BIG_IDX), 1)
        am = tl.where(cm > m, ca, am)
        nm = tl.maximum(m, cm)
        ns = tl.where(nm == NEG_INF, 0.0, nm)
        s = s * tl.exp2((m - ns) * c2) + tl.sum(tl.exp2((x - ns[:, None]) * c2[:, None]), 1)
        m = nm
    out = part + (r * tl.num_programs(1) + split) * 4
    tl.store(out, m, mask=rm)
    tl.store(out + 1, s, mask=rm)
    tl.store(out + 2, am.to(tl.float32), mask=rm)
    tl.store(out + 3, bad.to(tl.float32), mask=rm)


@triton.jit
def tree_stats_merge_kernel(part, temp_ptr, temp, ws, base, B, W, splits,
                            ROWS: tl.constexpr, SP2: tl.constexpr, ROW_TEMP: tl.constexpr,
                            INTERPRET: tl.constexpr):
    """The splits of rows r merged, stored at ws[base + r * N_STAT + 0..3]: max/T,
    log Σ exp((x - max)/T), first argmax, poisoned (1.0: NaN/+inf, a row of only -inf, a bad
    temperature, max/T overflowing). One split is the partial unchanged."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = r < B * W
    scale, c2, greedy, badt = _row_temps(temp_ptr, temp, r // W, rm, ROW_TEMP)
    sp = tl.arange(0, SP2)[None, :]
    ok = rm[:, None] & (sp < splits)
    at = part + (r[:, None] * splits + sp) * 4
    pm = tl.load(at, mask=ok, other=NEG_INF)
    ps = tl.load(at + 1, mask=ok, other=0.0)
    pa = tl.load(at + 2, mask=ok, other=BIG_IDX).to(tl.int32)
    bad = badt | (tl.max(tl.load(at + 3, mask=ok, other=0.0), 1) > 0.0)
    m = tl.max(pm, 1)
    am = tl.min(tl.where(pm == m[:, None], pa, BIG_IDX), 1)
    ns = tl.where(m == NEG_INF, 0.0, m)
    s = tl.sum(tl.where(pm == NEG_INF, 0.0, ps * tl.exp2((pm - ns[:, None]) * c2[:, None])), 1)
    bad = bad | (m == NEG_INF) | (s != s)
    mz = tl.math.div_rn(tl.where(bad, 0.0, m), scale)
    bad = bad | ~(mz <= FLT_MAX)
    out = ws + base + r * 4
    tl.store(out, mz, mask=rm)
    tl.store(out + 1, _log(tl.where(bad, 1.0, s), INTERPRET), mask=rm)
    tl.store(out + 2, am.to(tl.float32), mask=rm)
    tl.store(out + 3, bad.to(tl.float32), mask=rm)


@triton.jit
def _prob(rows_ptr, offs, msk, scale, mz, ls, INTERPRET: tl.constexpr):
    """exp(log-softmax) at tokens offs of rows (pointers [ROWS]), 0 where masked."""
    x = tl.load(rows_ptr[:, None] + offs, mask=msk, other=NEG_INF).to(tl.float32)
    z = tl.math.div_rn(x, scale[:, None])
    return _exp((z - mz[:, None]) - ls[:, None], INTERPRET)


@triton.jit
def _residual(p, q, offs, nrej, rx, rs, rq, HAS_Q: tl.constexpr):
    """(w, q) at tokens offs after each row's ``nrej`` rejected siblings (tokens rx, masses
    S_j in rs and Q_j in rq): reference ``drop_rejected`` applied in order."""
    w = p
    cols = tl.arange(0, rx.shape[1])[None, :]
    for j in range(0, tl.max(nrej, 0)):
        on = (j < nrej)[:, None]
        at = cols == j                           # column j of the [ROWS, KP2] tiles
        hit = on & (offs == tl.sum(tl.where(at, rx, 0), 1)[:, None])
        if HAS_Q:
            s_j = tl.sum(tl.where(at, rs, 0.0), 1)[:, None]
            q_j = tl.sum(tl.where(at, rq, 0.0), 1)[:, None]
            w = tl.where(on, tl.maximum(tl.math.div_rn(w, s_j) - tl.math.div_rn(q, q_j), 0.0), w)
            q = tl.where(hit, 0.0, q)
        else:
            w = tl.where(hit, 0.0, w)
    return w, q


@triton.jit
def _node_probs(prow, qrow, offs, msk, scale, mp, lsp, mq, lsq, nrej, rx, rs, rq,
                HAS_Q: tl.constexpr, INTERPRET: tl.constexpr):
    """(w, q, p) at tokens offs: the residual, the draft's q (zero when one-hot) and p."""
    p = _prob(prow, offs, msk, scale, mp, lsp, INTERPRET)
    q = tl.zeros_like(p)
    if HAS_Q:
        q = _prob(qrow, offs, msk, scale, mq, lsq, INTERPRET)
    w, q = _residual(p, q, offs, nrej, rx, rs, rq, HAS_Q)
    return w, q, p


@triton.jit
def _residual_mass(prow, qrow, need, scale, mp, lsp, mq, lsq, nrej, rx, rs, rq, V,
                   ROWS: tl.constexpr, BT: tl.constexpr, HAS_Q: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """Σ_v w(v) of the current residual, streamed over V in BT-wide tiles."""
    tot = tl.zeros([ROWS], tl.float32)
    for v0 in range(0, V, BT):
        offs = v0 + tl.arange(0, BT)[None, :]
        w, q, p = _node_probs(prow, qrow, offs, need[:, None] & (offs < V), scale, mp, lsp, mq,
                              lsq, nrej, rx, rs, rq, HAS_Q, INTERPRET)
        tot += tl.sum(w, 1)
    return tot


@triton.jit
def _race(prow, qrow, need, key, scale, mp, lsp, mq, lsq, nrej, rx, rs, rq, V,
          ROWS: tl.constexpr, BT: tl.constexpr, HAS_Q: tl.constexpr, INTERPRET: tl.constexpr):
    """reference.block_race on the residual (p where the residual has no mass): the block
    argmax_k log W_k - log E_k (uniform at V + 1 + k), then the token argmax_v log w_v - log E_v
    inside that block (uniform at v). Streams V once, then reads one block again; each RBLK
    block is one BT-wide tile (BT = RBLK, or a power of two >= V when V < RBLK)."""
    best_w = tl.full([ROWS], NEG_INF, tl.float32)
    best_p = tl.full([ROWS], NEG_INF, tl.float32)
    k_w = tl.zeros([ROWS], tl.int32)
    k_p = tl.zeros([ROWS], tl.int32)
    mass = tl.zeros([ROWS], tl.float32)
    for k in range(0, tl.cdiv(V, RBLK)):
        offs = k * RBLK + tl.arange(0, BT)[None, :]
        w, q, p = _node_probs(prow, qrow, offs, need[:, None] & (offs < V), scale, mp, lsp, mq,
                              lsq, nrej, rx, rs, rq, HAS_Q, INTERPRET)
        u = _uniform(key, tl.zeros([ROWS], tl.int32) + (V + 1 + k), INTERPRET)
        le = _log(-_log(u, INTERPRET), INTERPRET)
        kw = _log(tl.sum(w, 1), INTERPRET) - le
        kp = _log(tl.sum(p, 1), INTERPRET) - le
        k_w = tl.where(kw > best_w, k, k_w)
        k_p = tl.where(kp > best_p, k, k_p)
        best_w = tl.maximum(best_w, kw)
        best_p = tl.maximum(best_p, kp)
        mass = tl.maximum(mass, tl.sum(w, 1))
    empty = mass == 0.0
    kstar = tl.where(empty, k_p, k_w)
    offs = kstar[:, None] * RBLK + tl.arange(0, BT)[None, :]
    msk = need[:, None] & (offs < V)
    w, q, p = _node_probs(prow, qrow, offs, msk, scale, mp, lsp, mq, lsq, nrej, rx, rs, rq,
                          HAS_Q, INTERPRET)
    w = tl.where(empty[:, None], p, w)
    u = _uniform(key[:, None], offs, INTERPRET)
    kv = tl.where(msk, _log(w, INTERPRET) - _log(-_log(u, INTERPRET), INTERPRET), NEG_INF)
    return kstar * RBLK + tl.argmax(kv, 1, tie_break_left=True)


@triton.jit(do_not_specialize=["seed", "seed_mode"])
def tree_walk_kernel(tgt, t_sb, drf, d_sb, tok, par, temp_ptr, temp, seed_ptr, seed, seed_mode,
                     ws, out, path, nacc, B, W, V, D,
                     ROWS: tl.constexpr, BT: tl.constexpr, KP2: tl.constexpr,
                     WP2: tl.constexpr, HAS_Q: tl.constexpr, ROW_TEMP: tl.constexpr, INTERPRET: tl.constexpr):
    """The recursive rejection walk of rows g * ROWS ..: writes out [B, D + 1] and path [B, D]
    (pre-filled with -1) and n_accepted [B] (-1: poisoned row)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = rows < B
    r64 = rows.to(tl.int64)
    scale, c2, greedy, bad = _row_temps(temp_ptr, temp, rows, rm, ROW_TEMP)
    seed_m = _load_seed_rt(seed_ptr, seed, seed_mode)
    ids = tl.arange(0, WP2)[None, :]
    nm = rm[:, None] & (ids < W)
    every = tl.load(tok + r64[:, None] * W + ids, mask=nm, other=0)
    flag = tl.load(ws + (rows[:, None] * W + ids) * 4 + 3, mask=nm, other=0.0)
    if HAS_Q:
        flag += tl.load(ws + B * W * 4 + (rows[:, None] * W + ids) * 4 + 3, mask=nm, other=0.0)
    bad = bad | (tl.max((nm & ((every < 0) | (every >= V))).to(tl.int32), 1) > 0)
    bad = bad | (tl.max(flag, 1) > 0.0)
    node = tl.zeros([ROWS], tl.int32)
    n = tl.zeros([ROWS], tl.int32)
    alive = rm & ~bad
    for d in range(0, D + 1):
        if tl.max(alive.to(tl.int32), 0) > 0:
            sr = (rows * W + node) * 4
            mp = tl.load(ws + sr, mask=alive, other=0.0)
            lsp = tl.load(ws + sr + 1, mask=alive, other=0.0)
            amp = tl.load(ws + sr + 2, mask=alive, other=0.0).to(tl.int32)
            mq = mp
            lsq = lsp
            if HAS_Q:
                mq = tl.load(ws + B * W * 4 + sr, mask=alive, other=0.0)
                lsq = tl.load(ws + B * W * 4 + sr + 1, mask=alive, other=0.0)
            prow = tgt + r64 * t_sb + node.to(tl.int64) * V
            qrow = drf + r64 * d_sb + node.to(tl.int64) * V
            chosen = tl.full([ROWS], -1, tl.int32)
            nrej = tl.zeros([ROWS], tl.int32)
            S = tl.full([ROWS], 1.0, tl.float32)
            Q = tl.full([ROWS], 1.0, tl.float32)
            rx = tl.zeros([ROWS, KP2], tl.int32)
            rs = tl.full([ROWS, KP2], 1.0, tl.float32)
            rq = tl.full([ROWS, KP2], 1.0, tl.float32)
            slots = tl.arange(0, KP2)[None, :]
            for i in range(1, W):
                pi = tl.load(par + r64 * W + i, mask=alive, other=-2).to(tl.int32)
                x = tl.load(tok + r64 * W + i, mask=alive, other=0).to(tl.int32)
                live = alive & (chosen < 0) & (pi == node) & ((node * 0 + d) < D)
                if tl.max(live.to(tl.int32), 0) > 0:
                    w1, q1, p1 = _node_probs(prow, qrow, x[:, None], live[:, None], scale, mp,
                                             lsp, mq, lsq, nrej, rx, rs, rq, HAS_Q, INTERPRET)
                    wx = tl.sum(w1, 1)
                    qx = tl.sum(q1, 1)
                    lpx = _log(wx, INTERPRET) - _log(S, INTERPRET)
                    lqx = tl.zeros([ROWS], tl.float32)
                    if HAS_Q:
                        lqx = _log(qx, INTERPRET) - _log(Q, INTERPRET)
                    key = _stream_key(seed_m, rows * W + i, INTERPRET)
                    u = _uniform(key, tl.zeros([ROWS], tl.int32) + V, INTERPRET)
                    ok_s = (lpx > NEG_INF) & (lqx > NEG_INF) & (_log(u, INTERPRET) < lpx - lqx)
                    ok = tl.where(greedy, x == amp, ok_s)
                    chosen = tl.where(live & ok, i, chosen)
                    rej = live & ~ok & ~greedy & (lqx > NEG_INF)
                    put = rej[:, None] & (slots == nrej[:, None])
                    rx = tl.where(put, x[:, None], rx)
                    rs = tl.where(put, S[:, None], rs)
                    rq = tl.where(put, Q[:, None], rq)
                    nrej += rej.to(tl.int32)
                    if HAS_Q:
                        Q = tl.where(rej, Q - qx, Q)
                        if tl.max(rej.to(tl.int32), 0) > 0:
                            S = tl.where(rej, _residual_mass(prow, qrow, rej, scale, mp, lsp, mq,
                                                             lsq, nrej, rx, rs, rq, V, ROWS,
                                                             BT, HAS_Q, INTERPRET), S)
                    else:
                        S = tl.where(rej, S - wx, S)
            need = alive & (chosen < 0) & ~greedy
            fix = amp
            if tl.max(need.to(tl.int32), 0) > 0:
                key = _stream_key(seed_m, rows * W + node, INTERPRET)
                drawn = _race(prow, qrow, need, key, scale, mp, lsp, mq, lsq, nrej, rx, rs, rq,
                              V, ROWS, BT, HAS_Q, INTERPRET)
                fix = tl.where(need, drawn, fix)
            go = alive & (chosen >= 0)
            took = tl.load(tok + r64 * W + tl.maximum(chosen, 0), mask=go, other=0)
            tl.store(out + r64 * (D + 1) + d, tl.where(go, took, fix.to(tl.int64)), mask=alive)
            tl.store(path + r64 * D + d, chosen.to(tl.int64), mask=go)
            n += go.to(tl.int32)
            node = tl.where(go, chosen, node)
            alive = go
    tl.store(nacc + r64, tl.where(bad, -1, n).to(tl.int64), mask=rm)


INTERPRET = interpreted(tree_walk_kernel)     # how the kernels were built (not a switch)


def verify_tree(target_logits: torch.Tensor, draft: TreeDraft, params: SamplingParams,
                seed: int | torch.Tensor = 0, temperature: torch.Tensor | None = None,
                depth: int | None = None, options: KernelOptions = DEFAULT
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused tree verification: (out [B, D + 1], n_accepted [B], path [B, D]) as the reference.
    ``depth`` is D (the deepest node; read from the draft, a host sync, when not given)."""
    check_tree_shapes(target_logits, draft)
    choice = choose("tree_verify", target_logits, draft_logits=draft.logits, params=params)
    if not choice.triton:
        log_once(choice.reason)
        return reference_tree.verify_tree(target_logits, draft, params, seed, temperature, depth)
    out, nacc, path = launch(target_logits, draft, params, seed, temperature,
                             int(draft.depth.max()) if depth is None else depth)
    if target_logits.device.type == "cpu" and bool((nacc < 0).any()):
        raise FloatingPointError("logits contain NaN or +inf (or a row is all -inf), a "
                                 "temperature is negative or a draft token is out of range")
    return out, nacc, path


def launch(target_logits: torch.Tensor, draft: TreeDraft, params: SamplingParams,
           seed: int | torch.Tensor, temperature: torch.Tensor | None, depth: int,
           splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the kernels (no fallback, no host sync); poisoned rows have n_accepted -1.
    ``splits``: programs per node row of the statistics pass (default: STAT_SPLITS on a GPU,
    1 under the interpreter)."""
    batch, width, vocab = target_logits.shape
    dev = target_logits.device
    out = torch.full((batch, depth + 1), -1, dtype=torch.long, device=dev)
    path = torch.full((batch, depth), -1, dtype=torch.long, device=dev)
    nacc = torch.empty(batch, dtype=torch.long, device=dev)
    if batch == 0:
        return out, nacc, path
    tgt = unit_rows(target_logits)
    has_q = draft.logits is not None
    drf = unit_rows(draft.logits) if has_q else tgt
    tok = draft.tokens.contiguous()
    par = draft.parents.contiguous()
    temp_ptr, temp = tgt, float(params.temperature)
    if temperature is not None:
        temp_ptr = temperature.to(device=dev).reshape(batch).contiguous()
    seed_ptr, seed_i, seed_mode = seed_args(seed, dev)
    ws = torch.empty(2 * batch * width * N_STAT, dtype=torch.float32, device=dev)
    if INTERPRET:      # few, big programs: the interpreter pays per program, not per element
        rows_s = max(1, min(next_pow2(batch * width), (1 << 20) // next_pow2(vocab)))
        rows_w = max(1, min(next_pow2(batch), (1 << 20) // min(RBLK.value, next_pow2(vocab))))
        splits = splits or 1
        chunk = min(next_pow2(triton.cdiv(vocab, splits)), 32768)
    else:              # a node's row in STAT_SPLITS programs: a lone row is latency bound
        rows_s, rows_w, chunk = 1, 1, 2048
        splits = splits or STAT_SPLITS
    splits = min(splits, triton.cdiv(vocab, chunk))
    # merge: the interpreter pays per program (64-row programs made it most of a tree gate's time)
    rows_m = min(next_pow2(batch * width), (1 << 20) // next_pow2(splits) if INTERPRET else 64)
    span = triton.cdiv(triton.cdiv(vocab, chunk), splits) * chunk
    part = torch.empty(batch * width * splits * N_STAT, dtype=torch.float32, device=dev)
    row_temp = temperature is not None
    for i, (src, sb) in enumerate(((tgt, tgt.stride(0)), (drf, drf.stride(0)))[:1 + has_q]):
        tree_stats_kernel[(triton.cdiv(batch * width, rows_s), splits)](
            src, sb, temp_ptr, temp, part, batch, width, vocab, span,
            ROWS=rows_s, CHUNK=chunk, ROW_TEMP=row_temp, num_warps=4)
        tree_stats_merge_kernel[(triton.cdiv(batch * width, rows_m),)](
            part, temp_ptr, temp, ws, i * batch * width * N_STAT, batch, width, splits,
            ROWS=rows_m, SP2=next_pow2(splits), ROW_TEMP=row_temp, INTERPRET=INTERPRET)
    tree_walk_kernel[(triton.cdiv(batch, rows_w),)](
        tgt, tgt.stride(0), drf, drf.stride(0), tok, par, temp_ptr, temp, seed_ptr, seed_i,
        seed_mode, ws, out, path, nacc, batch, width, vocab, depth,
        ROWS=rows_w, BT=min(RBLK.value, next_pow2(vocab)), KP2=next_pow2(width), WP2=next_pow2(width), HAS_Q=has_q,
        ROW_TEMP=row_temp, INTERPRET=INTERPRET, num_warps=4)
    return out, nacc, path
