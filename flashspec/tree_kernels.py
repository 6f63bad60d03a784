"""The bookkeeping of :func:`flashspec.tree.grow_tree` in Triton: one kernel per depth and one
for a dynamic tree's final choice of nodes, one program per row.

In torch, each depth of a tree's growth (new node ids, tokens, parents, depths, cumulative
scores, ancestor bitmasks, the next frontier and its gathers) is about thirty small kernels,
and a dynamic tree's final selection and renumbering twenty more, so a tree step launched far
more kernels than a chain step, and at this model size a step's time follows its kernel count.
Here each is a single launch. The results equal the torch path's exactly (same float32
sums and minima; ties go to the smaller node id, as a stable descending sort gives), except
that a sampled dynamic tree's ranks take an exp and a log, which a GPU may round differently
from torch (interpreted on the CPU they agree).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bit(node, w: tl.constexpr):
    """Bit of ``node`` (int tensor) in word ``w`` of an ancestor bitmask (0 outside it)."""
    inside = (node >= 64 * w) & (node < 64 * w + 64)
    shift = tl.where(inside, node - 64 * w, 0).to(tl.int64)
    return tl.where(inside, tl.full(shift.shape, 1, tl.int64) << shift, 0)


@triton.jit
def _depth_kernel(tok_ptr, lp_ptr, front_ptr, root_ptr, tokens_ptr, parents_ptr, depth_ptr,
                  score_ptr, path_ptr, bits_ptr, next_ptr, ntok_ptr, npar_ptr, nbits_ptr, M1,
                  used, d, F: tl.constexpr, K: tl.constexpr, NP: tl.constexpr,
                  NEXT: tl.constexpr, NEXTP: tl.constexpr, SELECT: tl.constexpr,
                  W: tl.constexpr, ROOT: tl.constexpr, PATH: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, NP)                      # new node c = (frontier slot i, child j)
    live = c < F * K
    i = c // K
    j = c % K
    if ROOT:         # the first depth: write the root's row (node 0), the only parent
        tl.store(tokens_ptr + b * M1, tl.load(root_ptr + b))
        tl.store(parents_ptr + b * M1, -1)
        tl.store(depth_ptr + b * M1, 0)
        tl.store(score_ptr + b * M1, 0.0)
        for w in tl.static_range(W):
            tl.store(bits_ptr + b * M1 * W + w, tl.sum(_bit(tl.zeros([1], tl.int64), w), axis=0))
        tl.debug_barrier()
        par = tl.zeros([NP], tl.int64)
    else:
        par = tl.load(front_ptr + b * F + i, mask=live, other=0)
    pscore = tl.load(score_ptr + b * M1 + par, mask=live, other=0.0)
    row_lp = lp_ptr + b * (F * K)
    own_lp = tl.load(row_lp + c, mask=live, other=0.0)
    if PATH:         # sampled dynamic tree: rank by the draft mass earlier siblings left
        ppath = tl.load(path_ptr + b * M1 + par, mask=live, other=0.0)
        before = tl.zeros([NP], tl.float32)
        for t in tl.static_range(1, K):       # q of the earlier siblings, first to last
            s = K - t
            earlier = live & (j >= s)
            before += tl.where(earlier, tl.exp(tl.load(row_lp + c - s, mask=earlier, other=0.0)), 0.0)
        score = tl.minimum(pscore, ppath + tl.log(tl.maximum(1.0 - before, 0.0)))
        tl.store(path_ptr + b * M1 + used + c, ppath + own_lp, mask=live)
    else:
        score = pscore + own_lp
        for s in tl.static_range(1, K):       # cummin over earlier siblings
            earlier = live & (j >= s)
            prev = pscore + tl.load(row_lp + c - s, mask=earlier, other=0.0)
            score = tl.where(earlier, tl.minimum(score, prev), score)
    node = used + c
    tok = tl.load(tok_ptr + b * (F * K) + c, mask=live, other=0)
    tl.store(tokens_ptr + b * M1 + node, tok, mask=live)
    tl.store(parents_ptr + b * M1 + node, par, mask=live)
    tl.store(depth_ptr + b * M1 + node, tl.zeros_like(par) + d, mask=live)
    tl.store(score_ptr + b * M1 + node, score, mask=live)
    for w in tl.static_range(W):
        above = tl.load(bits_ptr + (b * M1 + par) * W + w, mask=live, other=0)
        tl.store(bits_ptr + (b * M1 + node) * W + w, above | _bit(node, w), mask=live)
    if SELECT:       # the NEXT best new nodes by score, best first, ties to the smaller id
        avail = live
        for t in tl.static_range(NEXT):
            top = tl.max(tl.where(avail, score, -float("inf")), axis=0)
            first = tl.min(tl.where(avail & (score == top), c, NP), axis=0)
            first = tl.where(first < NP, first, tl.min(tl.where(avail, c, NP), axis=0))  # NaN
            pick = c == first
            tl.store(next_ptr + b * NEXT + t, used + first)
            tl.store(ntok_ptr + b * NEXT + t, tl.sum(tl.where(pick, tok, 0), axis=0))
            tl.store(npar_ptr + b * NEXT + t, tl.sum(tl.where(pick, par, 0), axis=0))
            avail = avail & ~pick
    else:            # every new node, in drafting order
        tl.store(next_ptr + b * NEXT + c, node, mask=live)
        tl.store(ntok_ptr + b * NEXT + c, tok, mask=live)
        tl.store(npar_ptr + b * NEXT + c, par, mask=live)
    tl.debug_barrier()                        # the new rows' bits are written
    t = tl.arange(0, NEXTP)
    ok = t < NEXT
    ids = tl.load(next_ptr + b * NEXT + t, mask=ok, other=0)
    for w in tl.static_range(W):
        word = tl.load(bits_ptr + (b * M1 + ids) * W + w, mask=ok, other=0)
        tl.store(nbits_ptr + (b * NEXT + t) * W + w, word, mask=ok)


@triton.jit
def _keep_kernel(tokens_ptr, parents_ptr, depth_ptr, score_ptr, ren_ptr, keep_ptr, otok_ptr,
                 opar_ptr, odepth_ptr, obits_ptr, M1,
                 MP: tl.constexpr, N: tl.constexpr, NP1: tl.constexpr, OW: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, MP)                      # candidate c + 1
    live = c < M1 - 1
    s = tl.load(score_ptr + b * M1 + 1 + c, mask=live, other=-float("inf"))
    avail = live
    kept = c < 0
    for t in tl.static_range(N):              # the N best candidates, ties to the smaller id
        top = tl.max(tl.where(avail, s, -float("inf")), axis=0)
        first = tl.min(tl.where(avail & (s == top), c, MP), axis=0)
        first = tl.where(first < MP, first, tl.min(tl.where(avail, c, MP), axis=0))
        kept = kept | (c == first)
        avail = avail & (c != first)
    rank = tl.cumsum(kept.to(tl.int32), axis=0)          # new ids 1..N in drafting order
    tl.store(ren_ptr + b * M1 + 1 + c, tl.where(kept, rank, -1).to(tl.int64), mask=live)
    tl.store(ren_ptr + b * M1, 0)
    tl.store(keep_ptr + b * (N + 1) + rank, (1 + c).to(tl.int64), mask=kept)
    tl.store(keep_ptr + b * (N + 1), 0)
    tl.debug_barrier()
    r = tl.arange(0, NP1)
    ok = r < N + 1
    kid = tl.load(keep_ptr + b * (N + 1) + r, mask=ok, other=0)
    tl.store(otok_ptr + b * (N + 1) + r, tl.load(tokens_ptr + b * M1 + kid, mask=ok), mask=ok)
    tl.store(odepth_ptr + b * (N + 1) + r, tl.load(depth_ptr + b * M1 + kid, mask=ok), mask=ok)
    p = tl.load(parents_ptr + b * M1 + kid, mask=ok, other=-1)
    newp = tl.load(ren_ptr + b * M1 + tl.maximum(p, 0), mask=ok & (p >= 0), other=-1)
    tl.store(opar_ptr + b * (N + 1) + r, newp, mask=ok)
    for w in tl.static_range(OW):             # the root's bitmask: bit 0
        tl.store(obits_ptr + b * (N + 1) * OW + w, tl.sum(_bit(tl.zeros([1], tl.int64), w), axis=0))
    for q in tl.static_range(1, N + 1):       # parents come first: their masks are complete
        tl.debug_barrier()
        pq = tl.load(opar_ptr + b * (N + 1) + q)
        for w in tl.static_range(OW):
            above = tl.load(obits_ptr + (b * (N + 1) + pq) * OW + w)
            own = tl.sum(_bit(tl.full([1], q, tl.int64), w), axis=0)
            tl.store(obits_ptr + (b * (N + 1) + q) * OW + w, above | own)


def grow_depth(tok: torch.Tensor, lp: torch.Tensor, frontier: torch.Tensor | None,
               tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
               score: torch.Tensor, bits: torch.Tensor, used: int, d: int, nxt: int,
               root: torch.Tensor | None = None, path: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One depth of growth (see :func:`flashspec.tree._grow_depth`, the torch form; ``path``
    as there: a sampled dynamic tree's own cumulative log q, in place). ``root``
    [B] (the first depth; ``frontier`` is then ignored, the root is the only parent): the root
    tokens; the kernel also writes the root's row (node 0), so the buffers need no
    initialisation."""
    batch, f, k = tok.shape
    words, m1 = bits.shape[-1], tokens.shape[1]
    dev = tok.device
    nxt_ids = torch.empty(batch, nxt, dtype=torch.long, device=dev)
    ntok = torch.empty_like(nxt_ids)
    npar = torch.empty_like(nxt_ids)
    nbits = torch.empty(batch, nxt, words, dtype=torch.long, device=dev)
    if batch:
        first = root is not None
        _depth_kernel[(batch,)](tok.contiguous(), lp.float().contiguous(),
                                tok if first else frontier.contiguous(),
                                root.contiguous() if first else tok,
                                tokens, parents, depth, score,
                                score if path is None else path, bits, nxt_ids, ntok, npar,
                                nbits, m1, used, d, F=f, K=k, NP=triton.next_power_of_2(f * k),
                                NEXT=nxt, NEXTP=triton.next_power_of_2(nxt),
                                SELECT=nxt < f * k, W=words, ROOT=first, PATH=path is not None)
    return nxt_ids, ntok, npar, nbits


def keep_best(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
              score: torch.Tensor, nodes: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dynamic tree's final choice (see :func:`flashspec.tree._keep_best`, the torch form)."""
    batch, m1 = tokens.shape
    dev = tokens.device
    words = -(-(nodes + 1) // 64)
    ren = torch.empty(batch, m1, dtype=torch.long, device=dev)
    keep = torch.empty(batch, nodes + 1, dtype=torch.long, device=dev)
    out = [torch.empty(batch, nodes + 1, dtype=torch.long, device=dev) for _ in range(3)]
    obits = torch.empty(batch, nodes + 1, words, dtype=torch.long, device=dev)
    if batch:
        _keep_kernel[(batch,)](tokens, parents, depth, score, ren, keep, *out, obits, m1,
                               MP=triton.next_power_of_2(m1 - 1), N=nodes,
                               NP1=triton.next_power_of_2(nodes + 1), OW=words)
    return keep, out[0], out[1], out[2], obits


@triton.jit
def _compact_kernel(k_ptr, v_ptr, hid_ptr, out_ptr, path_ptr, len_ptr, s_hb, s_hn, C, LAYERS,
                    D: tl.constexpr, DP1: tl.constexpr, E: tl.constexpr, EP: tl.constexpr,
                    HDIM: tl.constexpr, DM: tl.constexpr, DMP: tl.constexpr):
    """Program l + (2 LAYERS + 1) b: l < 2 LAYERS moves layer l % LAYERS of K (l < LAYERS) or
    V of row b (every head, the D path slots read before any is written); l = 2 LAYERS gathers
    row b's hidden states of the root and the path. Rows and jobs share grid axis 0 (CUDA
    allows 2^31 - 1 programs there, 65,535 on the others): any batch fits in the launch."""
    jobs = 2 * LAYERS + 1
    l = tl.program_id(0) % jobs
    b = (tl.program_id(0) // jobs).to(tl.int64)
    batch = (tl.num_programs(0) // jobs).to(tl.int64)
    n = tl.arange(0, DP1)
    # (the compiler wants a name bound in both branches of an `if` to have one type: the
    # branches' tiles have their own names)
    if l < 2 * LAYERS:
        on_path = n < D
        p = tl.load(path_ptr + b * D + n, mask=on_path, other=-1)
        length = tl.load(len_ptr + b)
        dst = length + n
        src = tl.where(p >= 0, length - 1 + p, dst)
        e = tl.arange(0, EP)                  # head * HDIM + lane
        head = (((l % LAYERS).to(tl.int64) * batch + b) * (E // HDIM) + e // HDIM) * C
        lane = (e % HDIM)[None, :]
        kv_mask = on_path[:, None] & (e < E)[None, :]
        at_src = (head[None, :] + src[:, None]) * HDIM + lane
        at_dst = (head[None, :] + dst[:, None]) * HDIM + lane
        if l < LAYERS:
            k_rows = tl.load(k_ptr + at_src, mask=kv_mask)
            tl.debug_barrier()                # a destination may be another slot's source
            tl.store(k_ptr + at_dst, k_rows, mask=kv_mask)
        else:
            v_rows = tl.load(v_ptr + at_src, mask=kv_mask)
            tl.debug_barrier()
            tl.store(v_ptr + at_dst, v_rows, mask=kv_mask)
    else:
        kept = n <= D
        node = tl.maximum(tl.load(path_ptr + b * D + n - 1, mask=kept & (n >= 1), other=0), 0)
        col = tl.arange(0, DMP)[None, :]
        h_mask = kept[:, None] & (col < DM)
        h_rows = tl.load(hid_ptr + b * s_hb + node[:, None] * s_hn + col, mask=h_mask)
        tl.store(out_ptr + (b * (D + 1) + n[:, None]) * DM + col, h_rows, mask=h_mask)


def compact(k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor, path: torch.Tensor,
            lengths: torch.Tensor) -> torch.Tensor:
    """:func:`flashspec.tree.compact_path` in one launch: K/V caches ``k``, ``v`` [layers, B,
    H, C, hd] moved in place, the root's and the path's hidden states returned."""
    layers, batch, heads, capacity, hd = k.shape
    depth, dm = path.shape[1], hidden.shape[-1]
    out = torch.empty(batch, depth + 1, dm, dtype=hidden.dtype, device=hidden.device)
    if batch:
        if hidden.stride(-1) != 1:
            hidden = hidden.contiguous()
        _compact_kernel[((2 * layers + 1) * batch,)](
            k, v, hidden, out, path.contiguous(), lengths.contiguous(), hidden.stride(0),
            hidden.stride(1), capacity, layers, D=depth,
            DP1=triton.next_power_of_2(depth + 1), E=heads * hd,
            EP=triton.next_power_of_2(heads * hd), HDIM=hd, DM=dm,
            DMP=triton.next_power_of_2(dm))
    return out
