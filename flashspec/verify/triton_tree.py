"""Fused Triton tree verification (contract: :func:`flashspec.verify.tree.verify_tree`).

The same counter-based random numbers as the reference, so both backends return the same
tokens for the same seed (up to float rounding of the log-sum-exp and of the residual masses,
which can only matter when a log-space test or a race is decided by ~1e-6). Every pass over
the vocabulary is spread over many programs; nothing streams V serially along a path:

1. ``tree_stats_kernel``: per (row, node) of the target logits (and of the draft logits when
   siblings were sampled) one streaming pass over V: max/T, log Σ exp, the first argmax and a
   poison flag (NaN/+inf, a row of only -inf, x/T overflowing). Every node in parallel, and on
   a GPU each node's vocabulary in STAT_SPLITS programs, which ``tree_stats_merge_kernel``
   combines (a lone vocabulary-wide row streamed by one program is latency bound).
2. ``tree_sibling_kernel``, once per sibling rank j: child j of *every* node is tested at once.
   A sibling test does not depend on the path that reached its node (its uniform is keyed by
   the child; the residual it meets depends on the node's own p, q and earlier children only),
   so all of them can run before the walk. The residual after rejected siblings is never
   materialised: it is a function of p(v), q(v) and, per rejected sibling j, the token x_j and
   the masses S_j = Σ w_j, Q_j = Σ q_j, re-applied per element wherever it is read (one-hot
   drafts: x_j zeroed, S_{j+1} = S_j - w_j(x_j); sampled siblings: w_{j+1} = max(0, w_j/S_j -
   q_j/Q_j), x_j leaves q, S_{j+1} summed over column spans by separate programs and merged by
   the next launch). The per-node state ping-pongs between two buffers, since a launch's
   programs read the previous launch's state while its split 0 writes the new one.
   ``TreeDraft.fanout`` bounds the launches without reading the parents.
3. ``tree_walk_kernel``: per row, from the root, each node's accepted child; it records where
   the walk stops.
4. ``tree_race_kernel`` and ``tree_bonus_kernel``: the correction/bonus token at that node by
   the reference's two-level race, the block masses one block a program, then the token inside
   the winning block.
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
def _residual_mass(prow, qrow, need, scale, mp, lsp, mq, lsq, nrej, rx, rs, rq, lo, hi, V,
                   ROWS: tl.constexpr, BT: tl.constexpr, HAS_Q: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """Σ_v w(v) of the current residual over columns [lo, hi), in BT-wide tiles."""
    tot = tl.zeros([ROWS], tl.float32)
    for v0 in range(lo, hi, BT):
        offs = v0 + tl.arange(0, BT)[None, :]
        w, q, p = _node_probs(prow, qrow, offs, need[:, None] & (offs < V) & (offs < hi), scale,
                              mp, lsp, mq, lsq, nrej, rx, rs, rq, HAS_Q, INTERPRET)
        tot += tl.sum(w, 1)
    return tot


@triton.jit
def _node_state(si, sf, r, rm, KP2: tl.constexpr):
    """A node's sibling state: (chosen, nrej, pending, S, Q, rx, rs, rq) of rows r."""
    slots = tl.arange(0, KP2)[None, :]
    ib = si + r * (3 + KP2)
    fb = sf + r * (2 + 2 * KP2)
    chosen = tl.load(ib, mask=rm, other=-1)
    nrej = tl.load(ib + 1, mask=rm, other=0)
    pend = tl.load(ib + 2, mask=rm, other=0)
    rx = tl.load(ib[:, None] + 3 + slots, mask=rm[:, None], other=0)
    S = tl.load(fb, mask=rm, other=1.0)
    Q = tl.load(fb + 1, mask=rm, other=1.0)
    rs = tl.load(fb[:, None] + 2 + slots, mask=rm[:, None], other=1.0)
    rq = tl.load(fb[:, None] + 2 + KP2 + slots, mask=rm[:, None], other=1.0)
    return chosen, nrej, pend, S, Q, rx, rs, rq


@triton.jit
def _node_stats(ws, r, rm, B, W, HAS_Q: tl.constexpr):
    """(max/T, log Σ, argmax) of p at rows r, and (max/T, log Σ) of q (p's when one-hot)."""
    mp = tl.load(ws + r * 4, mask=rm, other=0.0)
    lsp = tl.load(ws + r * 4 + 1, mask=rm, other=0.0)
    amp = tl.load(ws + r * 4 + 2, mask=rm, other=0.0).to(tl.int32)
    mq = mp
    lsq = lsp
    if HAS_Q:
        mq = tl.load(ws + B * W * 4 + r * 4, mask=rm, other=0.0)
        lsq = tl.load(ws + B * W * 4 + r * 4 + 1, mask=rm, other=0.0)
    return mp, lsp, amp, mq, lsq


@triton.jit(do_not_specialize=["seed", "seed_mode", "j"])
def tree_sibling_kernel(tgt, t_sb, drf, d_sb, tok, par, dep, temp_ptr, temp, seed_ptr, seed,
                        seed_mode, ws, si_in, sf_in, si_out, sf_out, p_in, p_out, B, W, V, D, j,
                        span, splits, ROWS: tl.constexpr, BT: tl.constexpr, KP2: tl.constexpr,
                        WP2: tl.constexpr, SP2: tl.constexpr, FIRST: tl.constexpr,
                        HAS_Q: tl.constexpr, ROW_TEMP: tl.constexpr, INTERPRET: tl.constexpr):
    """Sibling test j (1-based) at every node n of every row b (state r = b * W + n) at once: node n's j-th child is
    tested as if the walk stood at n with its earlier children not accepted, which is
    path-independent (its uniform is keyed by the child, the residual depends on the node's
    own p, q and earlier children only). A rejection of a sampled sibling leaves the new
    residual mass as partial sums over the ``splits`` column spans of program axis 1
    (``p_out``), merged by the next launch (``pending``); split 0 stores the state."""
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    split = tl.program_id(1)
    rm = i < B * W
    n = i // B          # node-major programs: a node without a j-th child skips as a whole
    b = i % B
    r = b * W + n
    b64 = b.to(tl.int64)
    scale, c2, greedy, badt = _row_temps(temp_ptr, temp, b, rm, ROW_TEMP)
    slots = tl.arange(0, KP2)[None, :]
    if FIRST:
        chosen = tl.full([ROWS], -1, tl.int32)
        nrej = tl.zeros([ROWS], tl.int32)
        pend = tl.zeros([ROWS], tl.int32)
        S = tl.full([ROWS], 1.0, tl.float32)
        Q = tl.full([ROWS], 1.0, tl.float32)
        rx = tl.zeros([ROWS, KP2], tl.int32)
        rs = tl.full([ROWS, KP2], 1.0, tl.float32)
        rq = tl.full([ROWS, KP2], 1.0, tl.float32)
    else:
        chosen, nrej, pend, S, Q, rx, rs, rq = _node_state(si_in, sf_in, r, rm, KP2)
        if HAS_Q:
            sp = tl.arange(0, SP2)[None, :]
            tot = tl.sum(tl.load(p_in + r[:, None] * splits + sp,
                                 mask=rm[:, None] & (sp < splits), other=0.0), 1)
            S = tl.where(pend != 0, tot, S)
    pend = tl.zeros([ROWS], tl.int32)
    mp, lsp, amp, mq, lsq = _node_stats(ws, r, rm, B, W, HAS_Q)
    ids = tl.arange(0, WP2)[None, :]
    inside = rm[:, None] & (ids >= 1) & (ids < W)
    pr = tl.load(par + b64[:, None] * W + ids, mask=inside, other=-2)
    kid = inside & (pr == n[:, None])
    pick = kid & (tl.cumsum(kid.to(tl.int32), 1) == j)
    has = tl.max(pick.to(tl.int32), 1) > 0
    child = tl.sum(tl.where(pick, ids, 0), 1)
    dn = tl.load(dep + b64 * W + n, mask=rm, other=0)
    x = tl.load(tok + b64 * W + child, mask=rm & has, other=0).to(tl.int32)
    live = rm & ~badt & has & (chosen < 0) & (dn < D) & (x >= 0) & (x < V)
    if tl.max(live.to(tl.int32), 0) > 0:
        prow = tgt + b64 * t_sb + n.to(tl.int64) * V
        qrow = drf + b64 * d_sb + n.to(tl.int64) * V
        w1, q1, p1 = _node_probs(prow, qrow, x[:, None], live[:, None], scale, mp, lsp, mq, lsq,
                                 nrej, rx, rs, rq, HAS_Q, INTERPRET)
        wx = tl.sum(w1, 1)
        qx = tl.sum(q1, 1)
        lpx = _log(wx, INTERPRET) - _log(S, INTERPRET)
        lqx = tl.zeros([ROWS], tl.float32)
        if HAS_Q:
            lqx = _log(qx, INTERPRET) - _log(Q, INTERPRET)
        seed_m = _load_seed_rt(seed_ptr, seed, seed_mode)
        key = _stream_key(seed_m, b * W + child, INTERPRET)
        u = _uniform(key, tl.zeros([ROWS], tl.int32) + V, INTERPRET)
        ok_s = (lpx > NEG_INF) & (lqx > NEG_INF) & (_log(u, INTERPRET) < lpx - lqx)
        ok = tl.where(greedy, x == amp, ok_s)
        chosen = tl.where(live & ok, child, chosen)
        rej = live & ~ok & ~greedy & (lqx > NEG_INF)
        put = rej[:, None] & (slots == nrej[:, None])
        rx = tl.where(put, x[:, None], rx)
        rs = tl.where(put, S[:, None], rs)
        rq = tl.where(put, Q[:, None], rq)
        nrej += rej.to(tl.int32)
        if HAS_Q:
            Q = tl.where(rej, Q - qx, Q)
            pend = rej.to(tl.int32)
            if tl.max(pend, 0) > 0:
                lo = split * span
                part = _residual_mass(prow, qrow, rej, scale, mp, lsp, mq, lsq, nrej, rx, rs, rq,
                                      lo, lo + span, V, ROWS, BT, HAS_Q, INTERPRET)
                tl.store(p_out + r * splits + split, tl.where(rej, part, 0.0), mask=rm)
        else:
            S = tl.where(rej, S - wx, S)
    if split == 0:
        ib = si_out + r * (3 + KP2)
        fb = sf_out + r * (2 + 2 * KP2)
        tl.store(ib, chosen, mask=rm)
        tl.store(ib + 1, nrej, mask=rm)
        tl.store(ib + 2, pend, mask=rm)
        tl.store(ib[:, None] + 3 + slots, rx, mask=rm[:, None])
        tl.store(fb, S, mask=rm)
        tl.store(fb + 1, Q, mask=rm)
        tl.store(fb[:, None] + 2 + slots, rs, mask=rm[:, None])
        tl.store(fb[:, None] + 2 + KP2 + slots, rq, mask=rm[:, None])


@triton.jit
def tree_walk_kernel(tok, temp_ptr, temp, ws, si, out, path, nacc, fin, B, W, V, D,
                     ROWS: tl.constexpr, KP2: tl.constexpr, WP2: tl.constexpr,
                     HAS_Q: tl.constexpr, ROW_TEMP: tl.constexpr):
    """The walk of rows g * ROWS ..: from the root, each node's accepted child (the sibling
    tests already ran at every node). Writes the accepted tokens into out [B, D + 1] and path
    [B, D] (pre-filled with -1), n_accepted [B] (-1: poisoned row) and, per row, fin = (the
    node where the walk stops, its depth); node -1 for a poisoned row."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = rows < B
    r64 = rows.to(tl.int64)
    scale, c2, greedy, bad = _row_temps(temp_ptr, temp, rows, rm, ROW_TEMP)
    ids = tl.arange(0, WP2)[None, :]
    nm = rm[:, None] & (ids < W)
    every = tl.load(tok + r64[:, None] * W + ids, mask=nm, other=0)
    flag = tl.load(ws + (rows[:, None] * W + ids) * 4 + 3, mask=nm, other=0.0)
    if HAS_Q:
        flag += tl.load(ws + B * W * 4 + (rows[:, None] * W + ids) * 4 + 3, mask=nm, other=0.0)
    bad = bad | (tl.max((nm & ((every < 0) | (every >= V))).to(tl.int32), 1) > 0)
    bad = bad | (tl.max(flag, 1) > 0.0)
    node = tl.zeros([ROWS], tl.int32)
    stop_d = tl.zeros([ROWS], tl.int32)
    n = tl.zeros([ROWS], tl.int32)
    alive = rm & ~bad
    for d in range(0, D + 1):
        ch = tl.load(si + (rows * W + node) * (3 + KP2), mask=alive, other=-1)
        go = alive & (ch >= 0)     # a node at depth D has no tested child
        stop_d = tl.where(alive & ~go, d, stop_d)
        took = tl.load(tok + r64 * W + tl.maximum(ch, 0), mask=go, other=0)
        tl.store(out + r64 * (D + 1) + d, took, mask=go)
        tl.store(path + r64 * D + d, ch.to(tl.int64), mask=go)
        n += go.to(tl.int32)
        node = tl.where(go, ch, node)
        alive = go
    tl.store(nacc + r64, tl.where(bad, -1, n).to(tl.int64), mask=rm)
    tl.store(fin + rows * 2, tl.where(bad, -1, node), mask=rm)
    tl.store(fin + rows * 2 + 1, stop_d, mask=rm)


@triton.jit(do_not_specialize=["seed", "seed_mode"])
def tree_race_kernel(tgt, t_sb, drf, d_sb, temp_ptr, temp, seed_ptr, seed, seed_mode, ws, si, sf,
                     fin, rk, B, W, V, nb, bps, ROWS: tl.constexpr, BT: tl.constexpr,
                     KP2: tl.constexpr, HAS_Q: tl.constexpr, ROW_TEMP: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """The block level of reference.block_race at the node where each sampled row's walk
    stopped: per RBLK block k of program axis 1's ``bps`` blocks, rk[(b, k)] =
    (log W_k - log E_k, log P_k - log E_k, W_k) of the residual w after the node's rejected
    children and of p (uniforms at V + 1 + k of the node's stream)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = rows < B
    scale, c2, greedy, badt = _row_temps(temp_ptr, temp, rows, rm, ROW_TEMP)
    node = tl.load(fin + rows * 2, mask=rm, other=-1)
    need = rm & ~greedy & (node >= 0)
    if tl.max(need.to(tl.int32), 0) > 0:
        r = rows * W + tl.maximum(node, 0)
        chosen, nrej, pend, S, Q, rx, rs, rq = _node_state(si, sf, r, need, KP2)
        mp, lsp, amp, mq, lsq = _node_stats(ws, r, need, B, W, HAS_Q)
        prow = tgt + rows.to(tl.int64) * t_sb + node.to(tl.int64) * V
        qrow = drf + rows.to(tl.int64) * d_sb + node.to(tl.int64) * V
        key = _stream_key(_load_seed_rt(seed_ptr, seed, seed_mode), r, INTERPRET)
        k0 = tl.program_id(1) * bps
        for k in range(k0, tl.minimum(k0 + bps, nb)):
            offs = k * RBLK + tl.arange(0, BT)[None, :]
            w, q, p = _node_probs(prow, qrow, offs, need[:, None] & (offs < V), scale, mp, lsp,
                                  mq, lsq, nrej, rx, rs, rq, HAS_Q, INTERPRET)
            u = _uniform(key, tl.zeros([ROWS], tl.int32) + (V + 1 + k), INTERPRET)
            le = _log(-_log(u, INTERPRET), INTERPRET)
            sw = tl.sum(w, 1)
            at = rk + (rows * nb + k) * 3
            tl.store(at, _log(sw, INTERPRET) - le, mask=need)
            tl.store(at + 1, _log(tl.sum(p, 1), INTERPRET) - le, mask=need)
            tl.store(at + 2, sw, mask=need)


@triton.jit(do_not_specialize=["seed", "seed_mode"])
def tree_bonus_kernel(tgt, t_sb, drf, d_sb, temp_ptr, temp, seed_ptr, seed, seed_mode, ws, si, sf,
                      fin, rk, out, B, W, V, D, nb, ROWS: tl.constexpr, BT: tl.constexpr,
                      KP2: tl.constexpr, NBP2: tl.constexpr, HAS_Q: tl.constexpr,
                      ROW_TEMP: tl.constexpr, INTERPRET: tl.constexpr):
    """The correction/bonus token where each walk stopped, into out[b, depth]: the argmax
    for greedy rows; for sampled ones the race's block from rk (p's blocks when the residual
    has no mass), then the token race inside that block."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = rows < B
    r64 = rows.to(tl.int64)
    scale, c2, greedy, badt = _row_temps(temp_ptr, temp, rows, rm, ROW_TEMP)
    node = tl.load(fin + rows * 2, mask=rm, other=-1)
    ok_row = rm & (node >= 0)
    r = rows * W + tl.maximum(node, 0)
    mp, lsp, amp, mq, lsq = _node_stats(ws, r, ok_row, B, W, HAS_Q)
    fix = amp
    need = ok_row & ~greedy
    if tl.max(need.to(tl.int32), 0) > 0:
        kk = tl.arange(0, NBP2)[None, :]
        at = rk + (rows[:, None] * nb + kk) * 3
        km = need[:, None] & (kk < nb)
        kw = tl.load(at, mask=km, other=NEG_INF)
        kp = tl.load(at + 1, mask=km, other=NEG_INF)
        empty = tl.max(tl.load(at + 2, mask=km, other=0.0), 1) == 0.0
        kstar = tl.where(empty, tl.argmax(kp, 1, tie_break_left=True),
                         tl.argmax(kw, 1, tie_break_left=True))
        chosen, nrej, pend, S, Q, rx, rs, rq = _node_state(si, sf, r, need, KP2)
        prow = tgt + r64 * t_sb + node.to(tl.int64) * V
        qrow = drf + r64 * d_sb + node.to(tl.int64) * V
        offs = kstar[:, None] * RBLK + tl.arange(0, BT)[None, :]
        msk = need[:, None] & (offs < V)
        w, q, p = _node_probs(prow, qrow, offs, msk, scale, mp, lsp, mq, lsq, nrej, rx, rs, rq,
                              HAS_Q, INTERPRET)
        w = tl.where(empty[:, None], p, w)
        key = _stream_key(_load_seed_rt(seed_ptr, seed, seed_mode), r, INTERPRET)
        u = _uniform(key[:, None], offs, INTERPRET)
        kv = tl.where(msk, _log(w, INTERPRET) - _log(-_log(u, INTERPRET), INTERPRET), NEG_INF)
        fix = tl.where(need, kstar * RBLK + tl.argmax(kv, 1, tie_break_left=True), fix)
    stop_d = tl.load(fin + rows * 2 + 1, mask=ok_row, other=0)
    tl.store(out + r64 * (D + 1) + stop_d, fix.to(tl.int64), mask=ok_row)


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
    ``splits``: programs per node row of the statistics pass and of the residual masses
    (default: STAT_SPLITS and ~2048 columns a program on a GPU, 1 under the interpreter, where
    a given ``splits`` also runs the race one block a program: the GPU's layout)."""
    gpu_layout = splits
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
    # the sibling tests of every node, one launch per sibling rank (state ping-pongs between
    # two buffers: a launch's programs read the previous launch's state while split 0 writes)
    # the host read of an unknown fanout is free on the CPU; on CUDA every node may be the widest
    fan = draft.most_children() if draft.fanout or dev.type == "cpu" else width - 1
    fan = max(1, min(width - 1, fan))
    kp2 = next_pow2(fan)
    si = torch.empty(2, batch * width * (3 + kp2), dtype=torch.int32, device=dev)
    sf = torch.empty(2, batch * width * (2 + 2 * kp2), dtype=torch.float32, device=dev)
    blocks = triton.cdiv(vocab, RBLK.value)
    bt = min(RBLK.value, next_pow2(vocab))
    rows_n = min(next_pow2(batch * width), (1 << 20) // bt) if INTERPRET else 1
    if INTERPRET and gpu_layout is None:
        sib_splits, bps = 1, blocks
    else:      # a node's residual mass in ~2048-column spans, its race one block a program
        sib_splits, bps = gpu_layout or min(64, triton.cdiv(vocab, 2048)), 1
    sib_span = triton.cdiv(triton.cdiv(vocab, sib_splits), bt) * bt
    sib_splits = triton.cdiv(vocab, sib_span)
    masses = torch.empty(2, batch * width * sib_splits, dtype=torch.float32, device=dev)
    tok_args = (tgt, tgt.stride(0), drf, drf.stride(0))
    rng_args = (temp_ptr, temp, seed_ptr, seed_i, seed_mode, ws)
    grid_n = triton.cdiv(batch * width, rows_n)
    for j in range(1, fan + 1):
        new, old = j % 2, (j - 1) % 2
        tree_sibling_kernel[(grid_n, sib_splits)](
            *tok_args, tok, par, draft.depth.contiguous(), *rng_args, si[old], sf[old], si[new],
            sf[new], masses[old], masses[new], batch, width, vocab, depth, j, sib_span,
            sib_splits, ROWS=rows_n, BT=bt, KP2=kp2, WP2=next_pow2(width),
            SP2=next_pow2(sib_splits), FIRST=j == 1, HAS_Q=has_q, ROW_TEMP=row_temp,
            INTERPRET=INTERPRET, num_warps=4)
    state = (si[fan % 2], sf[fan % 2])
    fin = torch.empty(batch * 2, dtype=torch.int32, device=dev)
    rk = torch.empty(batch * blocks * 3, dtype=torch.float32, device=dev)
    grid_b = triton.cdiv(batch, rows_w)
    tree_walk_kernel[(grid_b,)](
        tok, temp_ptr, temp, ws, state[0], out, path, nacc, fin, batch, width, vocab, depth,
        ROWS=rows_w, KP2=kp2, WP2=next_pow2(width), HAS_Q=has_q, ROW_TEMP=row_temp,
        num_warps=4)
    tree_race_kernel[(grid_b, triton.cdiv(blocks, bps))](
        *tok_args, *rng_args, *state, fin, rk, batch, width, vocab, blocks, bps, ROWS=rows_w,
        BT=bt, KP2=kp2, HAS_Q=has_q, ROW_TEMP=row_temp, INTERPRET=INTERPRET, num_warps=4)
    tree_bonus_kernel[(grid_b,)](
        *tok_args, *rng_args, *state, fin, rk, out, batch, width, vocab, depth, blocks,
        ROWS=rows_w, BT=bt, KP2=kp2, NBP2=next_pow2(blocks), HAS_Q=has_q, ROW_TEMP=row_temp,
        INTERPRET=INTERPRET, num_warps=4)
    return out, nacc, path
