"""Triton kernels of fused exact verification (contract: flashspec.verify.triton_backend.verify).

Two passes over the logits, each a grid over (vocabulary chunk, row group[, position]):

1. ``stats_kernel``: per (row, position, chunk) the max, the log-sum-exp partial sum
   (temperature applied, top-k mask applied) and the first argmax of p, and the same (no
   argmax) of q in the same program, each chunk loaded as one tile and reduced directly.
   The last program of a row group (atomic counter) or a separate ``decide_kernel`` decides
   with no serial chain over the drafts: the partials of all G+1 target and G draft positions
   are merged as [ROWS, G_P2, NC_P2] tiles, the draft tokens' logits gathered at once, the
   accept tests run in log space on registers, and j* is the first failing position.
2. ``race_kernel``: only position j* of each stochastic row is read again, for the
   two-level exponential race of ``reference.block_race`` over the weights w = max(0, p - q)
   (p for the bonus): every program streams its chunk and stores the mass of each RBLK-token
   block (a reduction, like pass 1: no random numbers, no serial chain). The last program of
   a row group (``FUSED``; otherwise ``finish_kernel``) draws the block by a race over the
   NB block masses, then the token by a race over that block's RBLK weights.

Layout contract: target rows [B, G+1, V] and draft rows [B, G, V] have unit strides inside a
batch row (t_sb, d_sb are the batch strides), tokens are a contiguous [B, G] tensor, and
``out`` is one int64 buffer holding the tokens [B, G+1] then n_accepted [B]. Chunk and block
counts are derived in the kernels (cdiv(V, CHUNK), cdiv(V, RBLK)); RCHUNK is RBLK times a
power of two.

Grids: CUDA allows 2^31 - 1 programs on grid axis 0 but only 65,535 on axes 1 and 2, so the
row group, which grows with the batch, shares axis 0 with the vocabulary chunk (program
c + NC * g: chunks fastest, the launch order of a (chunk, group) grid) and axis 1 holds only
the position j (γ + 1 programs; longer drafts fall back to the reference). Any batch then fits
in one launch, with no launch added for small batches.

Random numbers are ``flashspec.verify.rng.uniform`` ported to uint32 arithmetic. On the GPU
the transcendental functions of the race are libdevice's (the ones torch's CUDA kernels
use); under TRITON_INTERPRET=1 they are numpy's.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

NEG_INF = tl.constexpr(float("-inf"))
POS_INF = tl.constexpr(float("inf"))
FLT_MAX = tl.constexpr(3.4028234663852886e38)
BIG_IDX = tl.constexpr(2**30)
RBLK = tl.constexpr(1024)            # tokens per block of the two-level race (reference.RACE_BLOCK)
N_ROWSTAT = tl.constexpr(5)          # jstar, Mz_p, logS_p, Mz_q, logS_q per row


# ----------------------------------------------------------------------------- rng
@triton.jit
def _mix32(x, WIDE: tl.constexpr):
    """lowbias32: uint32 wrapping arithmetic, or uint64 masked to 32 bits when WIDE.

    WIDE is used under the interpreter, whose overflow sanitiser costs several array passes
    per 32-bit multiply; both forms give the same bits.
    """
    if WIDE:
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x = x ^ (x >> 15)
        x = (x * 0x846CA68B) & 0xFFFFFFFF
    else:
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _stream_key(seed_mixed, stream, WIDE: tl.constexpr):
    """mix32(mix32(seed) ^ stream * GOLDEN); ``seed_mixed`` is mix32(seed) already."""
    if WIDE:
        k = seed_mixed.to(tl.uint64) ^ ((stream.to(tl.uint64) * 0x9E3779B9) & 0xFFFFFFFF)
    else:
        k = seed_mixed ^ (stream.to(tl.uint32) * 0x9E3779B9)
    return _mix32(k, WIDE)


@triton.jit
def _uniform(key, index, WIDE: tl.constexpr):
    """rng.uniform for a stream key and int indices: (h >> 9 + 0.5) / 2^23, strictly in (0, 1)."""
    if WIDE:
        h = _mix32(key ^ ((index.to(tl.uint64) * 0x846CA68B + 1) & 0xFFFFFFFF), WIDE)
    else:
        h = _mix32(key ^ (index.to(tl.uint32) * 0x846CA68B + 1), WIDE)
    return ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _load_seed(seed_ptr, seed, SEED_PTR: tl.constexpr):
    """mix32(seed mod 2^32) from a device int64 scalar (no host read) or an int32 arg."""
    if SEED_PTR:
        s = tl.load(seed_ptr).to(tl.uint32)
    else:
        s = seed.to(tl.uint32, bitcast=True)
    return _mix32(s, False)


@triton.jit
def _load_seed_rt(seed_ptr, seed, seed_mode):
    """_load_seed with a runtime choice (one compiled variant for both seed kinds); seed_ptr
    always points at a valid int64 (a dummy when seed_mode is 0)."""
    s = tl.where(seed_mode != 0, tl.load(seed_ptr).to(tl.uint32),
                 seed.to(tl.uint32, bitcast=True))
    return _mix32(s, False)


# ----------------------------------------------------------------------------- math
@triton.jit
def _log(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.log(x)
    else:
        return libdevice.log(x)


@triton.jit
def _exp(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _row_temps(temp_ptr, temp, rows, rmask, ROW_TEMP: tl.constexpr):
    """(scale, log2(e)/scale, greedy, bad) per row: scale = T, or 1 for greedy rows."""
    if ROW_TEMP:
        t = tl.load(temp_ptr + rows, mask=rmask, other=1.0).to(tl.float32)
    else:
        t = tl.zeros(rows.shape, tl.float32) + temp
    greedy = t == 0.0
    bad = ~(t >= 0.0) | (t == POS_INF)
    scale = tl.where(greedy | bad, 1.0, t)
    return scale, 1.4426950408889634 / scale, greedy, bad


@triton.jit
def _layout(B, G, NC, V):
    """Float32 workspace offsets: p/q partials, row stats, thresholds, race block masses
    (W then P, B x cdiv(V, RBLK) each), top-k candidates."""
    R = B * (G + 1)
    RQ = B * G
    p_m = 0
    p_s = R * NC
    p_i = 2 * R * NC
    q_m = 3 * R * NC
    q_s = q_m + RQ * NC
    rowstat = q_s + RQ * NC
    thr_p = rowstat + N_ROWSTAT * B
    thr_q = thr_p + R
    race = thr_q + RQ
    cand = race + 2 * B * tl.cdiv(V, RBLK)
    return p_m, p_s, p_i, q_m, q_s, rowstat, thr_p, thr_q, race, cand


# ----------------------------------------------------------------------------- pass 1
@triton.jit
def _direct_stats(x, offs, c2):
    """(max, sum of exp2((x - max) * c2), first argmax) per row of a whole chunk: a row of only
    -inf gets max -inf, sum 0 and index BIG_IDX; NaN makes the sum NaN, +inf the max +inf."""
    M = tl.max(x, 1)
    Ms = tl.where(M == NEG_INF, 0.0, M)
    S = tl.sum(tl.exp2((x - Ms[:, None]) * c2[:, None]), 1)
    am = tl.min(tl.where(x == M[:, None], offs, BIG_IDX), 1)
    return M, S, tl.where(S == 0.0, BIG_IDX, am)


@triton.jit
def _masked_logits(ptrs, msk, offs, scale, thr, TOPK: tl.constexpr):
    """One tile of logits as float32 (-inf outside the mask or below the top-k threshold)."""
    x = tl.load(ptrs[:, None] + offs[None, :], mask=msk, other=NEG_INF).to(tl.float32)
    if TOPK:
        z = tl.math.div_rn(x, scale[:, None])
        x = tl.where(z < thr[:, None], NEG_INF, x)
    return x


@triton.jit
def _chunk_stats(p_rows, q_rows, rmask, qmask, v0, V, scale, c2, thp, thq,
                 ROWS: tl.constexpr, CHUNK: tl.constexpr, HAS_Q: tl.constexpr,
                 TOPK: tl.constexpr):
    """Stats of one chunk of p (max, sum, argmax) and q (max, sum): each is loaded as one tile
    (every load in flight together) and reduced directly (``_direct_stats``)."""
    offs = v0 + tl.arange(0, CHUNK)
    vm = (offs < V)[None, :]
    x = _masked_logits(p_rows, rmask[:, None] & vm, offs, scale, thp, TOPK)
    mp, sp, ip = _direct_stats(x, offs[None, :], c2)
    mq = tl.zeros([ROWS], tl.float32)
    sq = mq
    if HAS_Q:
        y = _masked_logits(q_rows, qmask[:, None] & vm, offs, scale, thq, TOPK)
        mq, sq, iq = _direct_stats(y, offs[None, :], c2)
    return mp, sp, ip, mq, sq


@triton.jit
def _store_stats(ws, base_m, base_s, base_i, r, c, NC, rmask, m, s, am, WITH_IDX: tl.constexpr):
    off = r * NC + c
    tl.store(ws + base_m + off, m, mask=rmask)
    tl.store(ws + base_s + off, s, mask=rmask)
    if WITH_IDX:
        tl.store(ws + base_i + off, am.to(tl.float32), mask=rmask)


@triton.jit
def _merge_tile(ws, base_m, base_s, base_i, r, pm, NC, scale, c2,
                NC_P2: tl.constexpr, WITH_IDX: tl.constexpr, INTERPRET: tl.constexpr):
    """Merge the chunk partials of a [ROWS, G_P2] tile of row-positions r (mask pm) with one
    [ROWS, G_P2, NC_P2] load each: (max/T, log sum, first argmax, poisoned?) per position."""
    cols = tl.arange(0, NC_P2)[None, None, :]
    cm = pm[:, :, None] & (cols < NC)
    off = r[:, :, None] * NC + cols
    m = tl.load(ws + base_m + off, mask=cm, other=NEG_INF, cache_modifier=".cg")
    s = tl.load(ws + base_s + off, mask=cm, other=0.0, cache_modifier=".cg")
    M = tl.max(m, 2)
    bad = ~(M <= FLT_MAX) | (M == NEG_INF)
    Ms = tl.where(bad, 0.0, M)
    S = tl.sum(s * tl.exp2((m - Ms[:, :, None]) * c2[:, :, None]), 2)
    am = tl.zeros_like(r)
    if WITH_IDX:
        idx = tl.load(ws + base_i + off, mask=cm, other=BIG_IDX, cache_modifier=".cg")
        am = tl.min(tl.where(m == M[:, :, None], idx, BIG_IDX), 2).to(tl.int32)
    Mz = tl.math.div_rn(Ms, scale)
    bad = bad | (S != S) | ~(Mz <= FLT_MAX)          # NaN/+inf logits, or x/T overflows
    S = tl.where(bad, 1.0, S)
    return Mz, _log(S, INTERPRET), am, bad


@triton.jit
def _token_logprob(ptr_rows, x, scale, thr, Mz, logS, msk, TOPK: tl.constexpr):
    """log-softmax value at token x: (x/T - max/T) - log S, -inf if top-k masks it."""
    xv = tl.load(ptr_rows + x, mask=msk, other=0.0).to(tl.float32)
    z = tl.math.div_rn(xv, scale)
    if TOPK:
        z = tl.where(z < thr, NEG_INF, z)
    return (z - Mz) - logS


@triton.jit
def _pick(v, sel):
    """Per row, the value of v [ROWS, G_P2] at the one selected position (sel)."""
    return tl.sum(tl.where(sel, v, tl.zeros_like(v)), 1)


@triton.jit
def _decide(g, tgt, t_sb, drf, d_sb, tok, temp_ptr, temp, seed_ptr, seed, seed_mode, ws, out, B, V,
            G: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
            NC_P2: tl.constexpr, G_P2: tl.constexpr, HAS_Q: tl.constexpr, TOPK: tl.constexpr,
            ROW_TEMP: tl.constexpr, INTERPRET: tl.constexpr):
    """Accept tests of one row group; writes accepted drafts, greedy fixes, n_accepted, j*.

    No serial chain: the partials of all G+1 target and G draft positions are merged as
    [ROWS, G_P2, NC_P2] tiles, the draft tokens' logits gathered at once, every position's
    accept test done in registers and j* (= n_accepted) is the first failing position.
    G_P2 is the power of two >= G + 1.
    """
    NC = tl.cdiv(V, CHUNK)
    p_m, p_s, p_i, q_m, q_s, rowstat, thr_p, thr_q, race, cand = _layout(B, G, NC, V)
    rows = g * ROWS + tl.arange(0, ROWS)
    rmask = rows < B
    rows64 = rows.to(tl.int64)
    scale, c2, greedy, bad = _row_temps(temp_ptr, temp, rows, rmask, ROW_TEMP)
    seed_m = _load_seed_rt(seed_ptr, seed, seed_mode)
    js = tl.arange(0, G_P2)[None, :]
    pm = rmask[:, None] & (js <= G)                  # target positions 0..G
    dm = rmask[:, None] & (js < G)                   # draft positions 0..G-1
    traw = tl.load(tok + rows64[:, None] * G + js, mask=dm, other=0)
    badx = dm & ((traw < 0) | (traw >= V))
    x = tl.where(badx, 0, traw).to(tl.int32)
    sc = scale[:, None] + tl.zeros([ROWS, G_P2], tl.float32)
    cc = c2[:, None] + tl.zeros([ROWS, G_P2], tl.float32)
    rp = rows[:, None] * (G + 1) + js
    mp, lsp, amp, badp = _merge_tile(ws, p_m, p_s, p_i, rp, pm, NC, sc, cc, NC_P2, True,
                                     INTERPRET)
    thp = _load_thr(ws, thr_p, rp, dm, TOPK)
    lp = _token_logprob(tgt + rows64[:, None] * t_sb + js * V, x, sc, thp, mp, lsp, dm, TOPK)
    mq = tl.zeros([ROWS, G_P2], tl.float32)
    lsq = mq
    lq = mq
    badq = badx
    if HAS_Q:
        rq = rows[:, None] * G + js
        mq, lsq, _unused, badq = _merge_tile(ws, q_m, q_s, p_i, rq, dm, NC, sc, cc, NC_P2,
                                             False, INTERPRET)
        thq = _load_thr(ws, thr_q, rq, dm, TOPK)
        lq = _token_logprob(drf + rows64[:, None] * d_sb + js * V, x, sc, thq, mq, lsq, dm, TOPK)
        badq = badx | badq
    u = _uniform(_stream_key(seed_m, rp, INTERPRET), tl.zeros([ROWS, G_P2], tl.int32) + V,
                 INTERPRET)
    ok_s = (_log(u, INTERPRET) < lp - lq) & (lq > NEG_INF) & (lp > NEG_INF)
    ok = tl.where(greedy[:, None], x == amp, ok_s)
    n = tl.min(tl.where(dm & ~ok, js, G), 1)         # first rejection j*, G if none
    bad = bad | (tl.max(((pm & badp) | (dm & badq)).to(tl.int32), 1) > 0)
    sel = js == n[:, None]
    _write_rows(traw, rows64, rmask, out, B, n, greedy, bad, _pick(amp, sel), js, G)
    need = rmask & ~greedy & ~bad
    base = ws + rowstat + rows * N_ROWSTAT
    tl.store(base, tl.where(need, n, -1).to(tl.float32), mask=rmask)
    tl.store(base + 1, _pick(mp, sel), mask=rmask)
    tl.store(base + 2, _pick(lsp, sel), mask=rmask)
    tl.store(base + 3, _pick(tl.where(dm, mq, 0.0), sel), mask=rmask)
    tl.store(base + 4, _pick(tl.where(dm, lsq, 0.0), sel), mask=rmask)


@triton.jit
def _write_rows(traw, rows64, rmask, out, B, n, greedy, bad, fix, js, G: tl.constexpr):
    """out[b, j]: draft if j < n, greedy fix (or -1 placeholder) at n, -1 after; poison -> -1.

    ``out`` holds the tokens [B, G+1] followed by n_accepted [B]; traw [ROWS, G_P2] are the
    draft tokens (0 past G-1).
    """
    nn = n[:, None]
    v = tl.where(js < nn, traw.to(tl.int64),
                 tl.where((js == nn) & greedy[:, None], fix[:, None].to(tl.int64), -1))
    tl.store(out + rows64[:, None] * (G + 1) + js, tl.where(bad[:, None], -1, v),
             mask=rmask[:, None] & (js <= G))
    tl.store(out + B * (G + 1) + rows64, tl.where(bad, -1, n).to(tl.int64), mask=rmask)


@triton.jit
def _load_thr(ws, base, r, rmask, TOPK: tl.constexpr):
    if TOPK:
        return tl.load(ws + base + r, mask=rmask, other=NEG_INF)
    else:
        return tl.zeros(r.shape, tl.float32)


@triton.jit(do_not_specialize=["seed", "seed_mode"])
def stats_kernel(tgt, t_sb, drf, d_sb, tok, temp_ptr, temp, seed_ptr, seed, seed_mode, ws, cnt,
                 out, B, V,
                 G: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
                 NC_P2: tl.constexpr, G_P2: tl.constexpr,
                 HAS_Q: tl.constexpr, TOPK: tl.constexpr, ROW_TEMP: tl.constexpr,
                 FUSED: tl.constexpr, INTERPRET: tl.constexpr):
    """Pass 1 over chunk c of position j (p, and q when j < G) for a group of ROWS rows.

    Rows are [G+1, V] (target) and [G, V] (draft) blocks with unit inner strides; t_sb and
    d_sb are the batch strides. With FUSED the last program of a row group decides.
    """
    NC = tl.cdiv(V, CHUNK)
    c = tl.program_id(0) % NC              # chunk and row group share axis 0 (module docstring)
    g = tl.program_id(0) // NC
    j = tl.program_id(1)
    p_m, p_s, p_i, q_m, q_s, rowstat, thr_p, thr_q, race, cand = _layout(B, G, NC, V)
    rows = g * ROWS + tl.arange(0, ROWS)
    rmask = rows < B
    rows64 = rows.to(tl.int64)
    scale, c2, greedy, badt = _row_temps(temp_ptr, temp, rows, rmask, ROW_TEMP)
    r = rows * (G + 1) + j
    jq = tl.minimum(j, G - 1)
    rq = rows * G + jq
    qmask = rmask & ((rows * 0 + j) < G)
    thp = _load_thr(ws, thr_p, r, rmask, TOPK)
    thq = _load_thr(ws, thr_q, rq, qmask, TOPK)
    mp, sp, ip, mq, sq = _chunk_stats(tgt + rows64 * t_sb + j * V, drf + rows64 * d_sb + jq * V,
                                      rmask, qmask, c * CHUNK, V, scale, c2, thp, thq, ROWS,
                                      CHUNK, HAS_Q, TOPK)
    _store_stats(ws, p_m, p_s, p_i, r, c, NC, rmask, mp, sp, ip, True)
    if HAS_Q:
        _store_stats(ws, q_m, q_s, p_i, rq, c, NC, qmask, mq, sq, ip, False)
    if FUSED:
        tl.debug_barrier()
        done = tl.atomic_add(cnt + g, 1, sem="acq_rel", scope="gpu")
        if done == NC * (G + 1) - 1:
            _decide(g, tgt, t_sb, drf, d_sb, tok, temp_ptr, temp, seed_ptr, seed, seed_mode, ws,
                    out, B, V,
                    G, ROWS, CHUNK, NC_P2, G_P2, HAS_Q, TOPK, ROW_TEMP, INTERPRET)
            tl.atomic_xchg(cnt + g, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["seed", "seed_mode"])
def decide_kernel(tgt, t_sb, drf, d_sb, tok, temp_ptr, temp, seed_ptr, seed, seed_mode, ws, out,
                  B, V,
                  G: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
                  NC_P2: tl.constexpr, G_P2: tl.constexpr,
                  HAS_Q: tl.constexpr, TOPK: tl.constexpr, ROW_TEMP: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """Unfused decide step: one program per row group."""
    _decide(tl.program_id(0), tgt, t_sb, drf, d_sb, tok, temp_ptr, temp, seed_ptr, seed, seed_mode,
            ws, out, B, V, G, ROWS, CHUNK, NC_P2, G_P2, HAS_Q, TOPK, ROW_TEMP, INTERPRET)


# ----------------------------------------------------------------------------- pass 2
@triton.jit
def _scaled(x, scale, UNIT: tl.constexpr):
    """x / T with IEEE division; UNIT (every T is 1) skips it: x / 1 is exactly x."""
    if UNIT:
        return x
    else:
        return tl.math.div_rn(x, scale[:, None])


@triton.jit
def _race_logp(tgt_rows, offs, msk, scale, Mp, lSp, thp, TOPK: tl.constexpr, UNIT: tl.constexpr):
    """log p at tokens offs (a tile of the row, broadcast against the row pointers)."""
    x = tl.load(tgt_rows[:, None] + offs, mask=msk, other=NEG_INF)
    return _logp_of(x, scale, Mp, lSp, thp, TOPK, UNIT)


@triton.jit
def _logp_of(x, scale, Mp, lSp, thp, TOPK: tl.constexpr, UNIT: tl.constexpr):
    """log p of loaded logits x (any float dtype; -inf where masked)."""
    z = _scaled(x.to(tl.float32), scale, UNIT)
    if TOPK:
        z = tl.where(z < thp[:, None], NEG_INF, z)
    return (z - Mp[:, None]) - lSp[:, None]


@triton.jit
def _weights(tgt_rows, drf_rows, xtok, offs, msk, is_res, scale, Mp, lSp, Mq, lSq, thp, thq,
             HAS_Q: tl.constexpr, TOPK: tl.constexpr, UNIT: tl.constexpr,
             INTERPRET: tl.constexpr):
    """Race weights at tokens offs: (w, p) with p = exp(log p) and w = max(0, p - q) at a
    rejected position (is_res), p at the bonus position (reference.race_weights)."""
    p = _exp(_race_logp(tgt_rows, offs, msk, scale, Mp, lSp, thp, TOPK, UNIT), INTERPRET)
    if HAS_Q:
        y = tl.load(drf_rows[:, None] + offs, mask=msk & is_res[:, None], other=NEG_INF)
        q = _exp(_logp_of(y, scale, Mq, lSq, thq, TOPK, UNIT), INTERPRET)
    else:
        q = tl.where(offs == xtok[:, None], 1.0, 0.0)
    return tl.where(is_res[:, None], tl.maximum(p - q, 0.0), p), p


@triton.jit
def _race_rows(g, tgt, t_sb, drf, d_sb, tok, temp_ptr, temp, ws, B, V, G: tl.constexpr,
               ROWS: tl.constexpr, CHUNK: tl.constexpr, TOPK: tl.constexpr,
               ROW_TEMP: tl.constexpr):
    """What pass 2 needs of row group g from the decide step: rows, which need a draw (need),
    whether it is residual (is_res), row pointers at j*, temperatures, draft token, stats."""
    NC = tl.cdiv(V, CHUNK)
    p_m, p_s, p_i, q_m, q_s, rowstat, thr_p, thr_q, race, cand = _layout(B, G, NC, V)
    rows = g * ROWS + tl.arange(0, ROWS)
    rmask = rows < B
    rows64 = rows.to(tl.int64)
    base = ws + rowstat + rows * N_ROWSTAT
    jf = tl.load(base, mask=rmask, other=-1.0, cache_modifier=".cg")
    need = rmask & (jf >= 0.0)
    j = tl.where(need, jf, 0.0).to(tl.int32)
    is_res = j < G
    jq = tl.where(is_res, j, 0)
    scale, c2, greedy, badt = _row_temps(temp_ptr, temp, rows, rmask, ROW_TEMP)
    Mp = tl.load(base + 1, mask=rmask, other=0.0, cache_modifier=".cg")   # with jf, not after
    lSp = tl.load(base + 2, mask=rmask, other=0.0, cache_modifier=".cg")
    Mq = tl.load(base + 3, mask=rmask, other=0.0, cache_modifier=".cg")
    lSq = tl.load(base + 4, mask=rmask, other=0.0, cache_modifier=".cg")
    r = rows * (G + 1) + j
    thp = _load_thr(ws, thr_p, r, need, TOPK)
    thq = _load_thr(ws, thr_q, rows * G + jq, need, TOPK)
    xtok = tl.load(tok + rows64 * G + jq, mask=need & is_res, other=-1).to(tl.int32)
    return (rows, need, j, r, is_res, tgt + rows64 * t_sb + j * V, drf + rows64 * d_sb + jq * V,
            scale, Mp, lSp, Mq, lSq, thp, thq, xtok)


@triton.jit(do_not_specialize=["seed", "seed_mode"])
def race_kernel(tgt, t_sb, drf, d_sb, tok, temp_ptr, temp, seed_ptr, seed, seed_mode, ws, cnt,
                out, B, V,
                G: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, RCHUNK: tl.constexpr,
                NB_P2: tl.constexpr, HAS_Q: tl.constexpr, TOPK: tl.constexpr,
                ROW_TEMP: tl.constexpr, FUSED: tl.constexpr, INTERPRET: tl.constexpr):
    """Pass 2, first level of the race: the masses of the RBLK-token blocks in chunk c at
    position j* of each stochastic row (residual W and p's P, for the empty-residual
    fallback). A streaming reduction: the chunk is one [NBLK, RBLK] tile (all its loads in
    flight together), no random numbers. With FUSED the last program of a row group draws the
    tokens (``_draw``)."""
    NCR = tl.cdiv(V, RCHUNK)
    c = tl.program_id(0) % NCR             # chunk and row group share axis 0 (module docstring)
    g = tl.program_id(0) // NCR
    p_m, p_s, p_i, q_m, q_s, rowstat, thr_p, thr_q, race, cand = _layout(B, G, tl.cdiv(V, CHUNK), V)
    NB = tl.cdiv(V, RBLK)
    (rows, need, j, r, is_res, tgt_rows, drf_rows, scale, Mp, lSp, Mq, lSq, thp, thq,
     xtok) = _race_rows(g, tgt, t_sb, drf, d_sb, tok, temp_ptr, temp, ws, B, V, G, ROWS, CHUNK,
                        TOPK, ROW_TEMP)
    if tl.max(need.to(tl.int32), 0) > 0:
        unit = tl.max(tl.abs(tl.where(need, scale, 1.0) - 1.0), 0) == 0.0
        NBLK: tl.constexpr = RCHUNK // RBLK          # the chunk as one [NBLK, RBLK] tile:
        blk = c * NBLK + tl.arange(0, NBLK)          # every load in flight before any sum
        offs = (blk[:, None] * RBLK + tl.arange(0, RBLK)[None, :])[None, :, :]
        msk = need[:, None, None] & (offs < V)
        tr = tgt_rows[:, None]
        dr = drf_rows[:, None]
        if unit:                                     # uniform per program: T = 1 everywhere
            w, p = _weights(tr, dr, xtok[:, None], offs, msk, is_res[:, None], scale[:, None],
                            Mp[:, None], lSp[:, None], Mq[:, None], lSq[:, None],
                            thp[:, None], thq[:, None], HAS_Q, TOPK, True, INTERPRET)
        else:
            w, p = _weights(tr, dr, xtok[:, None], offs, msk, is_res[:, None], scale[:, None],
                            Mp[:, None], lSp[:, None], Mq[:, None], lSq[:, None],
                            thp[:, None], thq[:, None], HAS_Q, TOPK, False, INTERPRET)
        dst = rows[:, None] * NB + blk[None, :]
        bm = need[:, None] & (blk[None, :] < NB)
        tl.store(ws + race + dst, tl.sum(w, 2), mask=bm)
        tl.store(ws + race + B * NB + dst, tl.sum(p, 2), mask=bm)
    if FUSED:
        tl.debug_barrier()
        counter = cnt + tl.cdiv(B, ROWS) + g
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == NCR - 1:
            _draw(g, tgt, t_sb, drf, d_sb, tok, temp_ptr, temp, seed_ptr, seed, seed_mode, ws,
                  out, B, V, G, ROWS, CHUNK, NB_P2, HAS_Q, TOPK, ROW_TEMP, INTERPRET)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _draw(g, tgt, t_sb, drf, d_sb, tok, temp_ptr, temp, seed_ptr, seed, seed_mode, ws, out,
          B, V, G: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
          NB_P2: tl.constexpr, HAS_Q: tl.constexpr, TOPK: tl.constexpr, ROW_TEMP: tl.constexpr,
          INTERPRET: tl.constexpr):
    """Second level of the race for row group g (reference.block_race): the block
    argmax_k log M_k - log E_k (E_k = -log u at index V + 1 + k; M = W, or P when the
    residual is empty), then the token argmax_v log w_v - log E_v inside that block."""
    p_m, p_s, p_i, q_m, q_s, rowstat, thr_p, thr_q, race, cand = _layout(B, G, tl.cdiv(V, CHUNK), V)
    NB = tl.cdiv(V, RBLK)
    (rows, need, j, r, is_res, tgt_rows, drf_rows, scale, Mp, lSp, Mq, lSq, thp, thq,
     xtok) = _race_rows(g, tgt, t_sb, drf, d_sb, tok, temp_ptr, temp, ws, B, V, G, ROWS, CHUNK,
                        TOPK, ROW_TEMP)
    key = _stream_key(_load_seed_rt(seed_ptr, seed, seed_mode), r, INTERPRET)
    cols = tl.arange(0, NB_P2)[None, :]
    cm = need[:, None] & (cols < NB)
    W = tl.load(ws + race + rows[:, None] * NB + cols, mask=cm, other=0.0, cache_modifier=".cg")
    P = tl.load(ws + race + B * NB + rows[:, None] * NB + cols, mask=cm, other=0.0,
                cache_modifier=".cg")
    empty = tl.max(W, 1) == 0.0                    # W >= 0: no residual mass at all
    M = tl.where(empty[:, None], P, W)
    uk = _uniform(key[:, None], V + 1 + cols, INTERPRET)
    kk = tl.where(cm, _log(M, INTERPRET) - _log(-_log(uk, INTERPRET), INTERPRET), NEG_INF)
    kstar = tl.argmax(kk, 1, tie_break_left=True)
    offs = kstar[:, None] * RBLK + tl.arange(0, RBLK)[None, :]
    msk = need[:, None] & (offs < V)
    w, p = _weights(tgt_rows, drf_rows, xtok, offs, msk, is_res, scale, Mp, lSp, Mq, lSq, thp,
                    thq, HAS_Q, TOPK, False, INTERPRET)
    w = tl.where(empty[:, None], p, w)
    u = _uniform(key[:, None], offs, INTERPRET)
    kv = tl.where(msk, _log(w, INTERPRET) - _log(-_log(u, INTERPRET), INTERPRET), NEG_INF)
    winner = (kstar * RBLK + tl.argmax(kv, 1, tie_break_left=True)).to(tl.int64)
    tl.store(out + rows.to(tl.int64) * (G + 1) + j, winner, mask=need)


@triton.jit(do_not_specialize=["seed", "seed_mode"])
def finish_kernel(tgt, t_sb, drf, d_sb, tok, temp_ptr, temp, seed_ptr, seed, seed_mode, ws,
                  out, B, V, G: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
                  NB_P2: tl.constexpr, HAS_Q: tl.constexpr, TOPK: tl.constexpr,
                  ROW_TEMP: tl.constexpr, INTERPRET: tl.constexpr):
    """Unfused second level of the race: one program per row group."""
    _draw(tl.program_id(0), tgt, t_sb, drf, d_sb, tok, temp_ptr, temp, seed_ptr, seed,
          seed_mode, ws, out, B, V, G, ROWS, CHUNK, NB_P2, HAS_Q, TOPK, ROW_TEMP, INTERPRET)


# ----------------------------------------------------------------------------- top-k
@triton.jit
def _order_key(z):
    """Order-preserving int32 key of a float32 (NaN excluded): flip the low bits of negatives."""
    i = z.to(tl.int32, bitcast=True)
    return i ^ ((i >> 31) & 0x7FFFFFFF)


@triton.jit
def _kth_largest_key(keys, k):
    """Per row, the k-th largest key counting duplicates: bisection over the int32 range."""
    keys = keys.to(tl.int64)
    lo = tl.full([keys.shape[0]], -2147483648, tl.int64)
    hi = tl.full([keys.shape[0]], 2147483648, tl.int64)
    for _ in range(32):
        mid = (lo + hi) >> 1
        ge = tl.sum((keys >= mid[:, None]).to(tl.int32), 1) >= k
        lo = tl.where(ge, mid, lo)
        hi = tl.where(ge, hi, mid)
    return lo.to(tl.int32)


@triton.jit
def topk_cand_kernel(src, s_sb, s_sj, temp_ptr, temp, ws, B, V, NC, NCT,
                     G: tl.constexpr, IS_Q: tl.constexpr, KP2: tl.constexpr,
                     BLOCK: tl.constexpr, ROWS: tl.constexpr, ROW_TEMP: tl.constexpr):
    """The KP2 largest values of x/T in one vocabulary tile (ties cut at KP2), per row-position.

    The union over tiles of these candidates has the same k-th largest value as the row.
    """
    c = tl.program_id(0) % NCT             # tile and row group share axis 0 (module docstring)
    g = tl.program_id(0) // NCT
    p_m, p_s, p_i, q_m, q_s, rowstat, thr_p, thr_q, race, cand = _layout(B, G, NC, V)
    NPOS: tl.constexpr = G if IS_Q else G + 1
    first = B * (G + 1) if IS_Q else 0
    r = g * ROWS + tl.arange(0, ROWS)
    rmask = r < B * NPOS
    b = r // NPOS
    scale, c2, greedy, badt = _row_temps(temp_ptr, temp, b, rmask, ROW_TEMP)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ptrs = src + b.to(tl.int64) * s_sb + (r % NPOS) * s_sj
    x = tl.load(ptrs[:, None] + offs[None, :], mask=rmask[:, None] & (offs < V)[None, :],
                other=NEG_INF).to(tl.float32)
    x = tl.where(x <= FLT_MAX, x, NEG_INF)
    z = tl.math.div_rn(x, scale[:, None])
    key = _order_key(z)
    kth = _kth_largest_key(key, KP2)
    gt = key > kth[:, None]
    eq = key == kth[:, None]
    pos = tl.where(gt, tl.cumsum(gt.to(tl.int32), 1),
                   tl.sum(gt.to(tl.int32), 1)[:, None] + tl.cumsum(eq.to(tl.int32), 1)) - 1
    keep = rmask[:, None] & (gt | eq) & (pos < KP2)
    dst = ws + cand + (first + r[:, None]) * (NCT * KP2) + c * KP2
    tl.store(dst + pos, z, mask=keep)


@triton.jit
def topk_thr_kernel(ws, B, V, NC, NCT, K,
                    G: tl.constexpr, IS_Q: tl.constexpr, KP2: tl.constexpr, NT_P2: tl.constexpr,
                    ROWS: tl.constexpr):
    """k-th largest of the per-tile candidates: the top-k threshold of each row-position."""
    g = tl.program_id(0)
    p_m, p_s, p_i, q_m, q_s, rowstat, thr_p, thr_q, race, cand = _layout(B, G, NC, V)
    NPOS: tl.constexpr = G if IS_Q else G + 1
    first = B * (G + 1) if IS_Q else 0
    r = g * ROWS + tl.arange(0, ROWS)
    rmask = r < B * NPOS
    cols = tl.arange(0, NT_P2)
    src = ws + cand + (first + r[:, None]) * (NCT * KP2) + cols[None, :]
    v = tl.load(src, mask=rmask[:, None] & (cols < NCT * KP2)[None, :], other=NEG_INF)
    kth = _kth_largest_key(_order_key(v), K)
    thr = (kth ^ ((kth >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    dst = thr_q if IS_Q else thr_p
    tl.store(ws + dst + r, thr, mask=rmask)
