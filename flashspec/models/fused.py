"""Fused decode layers: about nine kernels per Llama layer for few-token cached steps.

The reference :class:`flashspec.models.llama.Block` launches ~45 small kernels per layer (norms,
RoPE, scatters, masked SDPA over the whole static cache, SiLU, adds); a CUDA-graph replay of a
verify step is then bound by kernel latency. For cached steps of at most ``MAX_TOKENS`` query
tokens per row (AR, verify and drafter steps, and the prefill: eagerly, 9 launches per layer
instead of ~45 also shorten it) a layer here is

1. ``add_rmsnorm``       residual + delta, then RMSNorm (Triton, fp32 inside)
2. q|k|v matmul          one ``F.linear`` on the merged weight (:func:`fuse_block`)
3. ``rope_cache_write``  RoPE of q and k from positions, k/v stored at slot = position (Triton)
4. ``decode_attention``  causal GQA attention over the row's own cache slots (Triton)
5. o_proj matmul
6. ``add_rmsnorm``
7. gate|up matmul        one ``F.linear`` on the merged weight
8. ``silu_mul``          (Triton)
9. down matmul           (its output is added to the residual by the next ``add_rmsnorm``)

The KV cache layout is the reference one (``KVCache.k[i]`` is [B, H_kv, capacity, D], slot p
holds position p), so fused and reference steps mix freely. Nothing host-side depends on
positions (the attention loop bound is read inside the kernel), so every launch is safe to
capture in a CUDA graph. Rounding follows the reference: fp32 math inside each kernel, and in
bf16/fp16 the intermediate values the reference rounds (normed states, cos/sin, the RoPE
products, SiLU) are rounded the same way. The kernels run on CUDA tensors, or on CPU tensors
under Triton's interpreter (``TRITON_INTERPRET=1`` before triton is imported; the tests).

They are swapped in at load: :func:`fuse_model` merges the weights and sets the model's
``decode_layers`` to :data:`LAYERS`; :mod:`flashspec.models.llama` never imports this module.
"""
from __future__ import annotations

import logging
import math
from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import nn
from triton.language.extra import libdevice

from flashspec.core import TreeAttention
from flashspec.kernels import DECODE_MAX_TOKENS, choose
from flashspec.matmul import linear
from flashspec.models.llama import LlamaLM, Linear
from flashspec.options import interpreted

MAX_TOKENS = DECODE_MAX_TOKENS   # query tokens per row up to which a cached step (prefill too)
                                 # is fused (the decode_layers rule's limit)
AR_BLOCK_M = 16     # query rows per attention program of a one-token (AR) step
log = logging.getLogger(__name__)
_warned: set[str] = set()


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _rmsnorm_row(x, w_ptr, cols, mask, d, eps, DT: tl.constexpr):
    """RMSNorm of one fp32 row x (zero where masked): x * rsqrt(mean(x²) + eps), rounded to DT
    as the reference rounds the normed state, times the weight; returned in fp32."""
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / d + eps)
    normed = (x * rstd).to(DT).to(tl.float32)
    return normed * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _add_rmsnorm_kernel(x_ptr, delta_ptr, res_ptr, out_ptr, w_ptr, d, eps,
                        HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    """One row: r = x (+ delta, stored to res), out = (r * rsqrt(mean(r²) + eps)) * w."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    DT = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * d + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x += tl.load(delta_ptr + row * d + cols, mask=mask, other=0.0).to(tl.float32)
        xr = x.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * d + cols, xr, mask=mask)
        x = xr.to(tl.float32)
    tl.store(out_ptr + row * d + cols, _rmsnorm_row(x, w_ptr, cols, mask, d, eps, DT).to(DT),
             mask=mask)


@triton.jit
def _cos_sin(freq, INTERPRET: tl.constexpr):
    """Accurate cos/sin (libdevice on the GPU: arguments reach thousands of radians)."""
    if INTERPRET:
        return tl.cos(freq), tl.sin(freq)
    else:
        return libdevice.cos(freq), libdevice.sin(freq)


@triton.jit
def _rotate(x_ptr, o_ptr, o_hs, heads, cos, sin, j, jmask, ok,
            HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate-half RoPE of ``heads`` heads at x_ptr (head stride 2 * HALF) into o_ptr (head
    stride o_hs) where ``ok``, each product rounded to o's dtype as the reference does."""
    DT = o_ptr.dtype.element_ty
    h = tl.arange(0, BLOCK_H)
    m = (h < tl.where(ok, heads, 0))[:, None] & jmask[None, :]
    src = x_ptr + h[:, None] * (2 * HALF) + j[None, :]
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
    a1 = (x1 * cos).to(DT).to(tl.float32)
    b1 = (x2 * sin).to(DT).to(tl.float32)
    a2 = (x2 * cos).to(DT).to(tl.float32)
    b2 = (x1 * sin).to(DT).to(tl.float32)
    dst = o_ptr + h[:, None] * o_hs + j[None, :]
    tl.store(dst, (a1 - b1).to(DT), mask=m)
    tl.store(dst + HALF, (a2 + b2).to(DT), mask=m)


@triton.jit
def _rope_cache_kernel(qkv_ptr, pos_ptr, slot_ptr, inv_freq_ptr, q_ptr, kc_ptr, vc_ptr, n,
                       capacity, rope_scale, s_cb, s_ch, s_cs,
                       H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       SLOTS: tl.constexpr, INTERPRET: tl.constexpr):
    """One token (b, t): q -> q buffer [B, n, H, D] rotated; k rotated and v copied into the
    cache at slot = position, or at slot_ptr[b, t] with SLOTS (draft-tree nodes: RoPE by depth,
    own slots) (cache strides s_cb, s_ch, s_cs; unit stride along D)."""
    tok = tl.program_id(0).to(tl.int64)
    b = tok // n
    DT = q_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + tok)
    j = tl.arange(0, BLOCK_HALF)
    jmask = j < HALF
    freq = pos.to(tl.float32) * tl.load(inv_freq_ptr + j, mask=jmask, other=0.0)
    cos, sin = _cos_sin(freq, INTERPRET)
    cos = (cos * rope_scale).to(DT).to(tl.float32)[None, :]
    sin = (sin * rope_scale).to(DT).to(tl.float32)[None, :]
    row = qkv_ptr + tok * ((H + 2 * HKV) * D)
    slot = pos
    if SLOTS:
        slot = tl.load(slot_ptr + tok)
    ok = (slot >= 0) & (slot < capacity)    # an out-of-range slot writes nothing
    _rotate(row, q_ptr + tok * (H * D), D, H, cos, sin, j, jmask, ok, HALF, BLOCK_HQ)
    kvoff = b * s_cb + slot * s_cs
    _rotate(row + H * D, kc_ptr + kvoff, s_ch, HKV, cos, sin, j, jmask, ok, HALF, BLOCK_HK)
    # v: a copy, both halves (head stride D in the qkv row, s_ch in the cache)
    h = tl.arange(0, BLOCK_HK)
    m = (h < tl.where(ok, HKV, 0))[:, None] & jmask[None, :]
    src = row + (H + HKV) * D + h[:, None] * D + j[None, :]
    dst = vc_ptr + kvoff + h[:, None] * s_ch + j[None, :]
    tl.store(dst, tl.load(src, mask=m, other=0.0), mask=m)
    tl.store(dst + HALF, tl.load(src + HALF, mask=m, other=0.0), mask=m)


@triton.jit
def _attend_block(q, k_ptr, v_ptr, kv, s, slot, d, dmask, hi, seen, scale, s_ks, m_i, l_i, acc,
                  IEEE: tl.constexpr):
    """One key block of the online softmax: key lanes ``s`` (the sequence positions the block
    covers, lanes at or past ``hi`` load nothing) read cache ``slot`` (``s`` itself for a chain;
    a tree node's ancestors sit elsewhere); queries see the lanes where ``seen``."""
    smask = (s < hi)[:, None] & dmask[None, :]
    k = tl.load(k_ptr + kv + slot[:, None] * s_ks + d[None, :], mask=smask, other=0.0)
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = tl.where(seen, scores * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptr + kv + slot[:, None] * s_ks + d[None, :], mask=smask, other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, path_ptr, base_ptr, o_ptr, n,
                             capacity, scale, s_kb, s_kh, s_ks, PW,
                             H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                             TREE: tl.constexpr, HB: tl.constexpr, IEEE: tl.constexpr):
    """Chain (program (b * HKV + kv head, query block)): the G = H / HKV query heads of one kv
    head for all n tokens of row b (query row m = t * G + g) against cache slots 0 .. max
    position; a query at position p sees slots <= p.

    TREE (program (b * HKV + kv head, node t * HB + head block)): one node, its query heads in
    rows 0 .. G - 1 (HB blocks of BLOCK_M heads when G > BLOCK_M), as an AR step lays out its
    one token. Row (b, t) of the path table path_ptr [B, n, PW] (:func:`flashspec.core.path_table`)
    holds the node's path length k, then the ids of its path, root first (node j sits at cache
    slot base + j, base = base_ptr[b]). The node attends the committed prefix (slots below
    base) and then its path: key lane s reads slot s below base and the slot of the path's
    (s - base + 1)-th node above it, the sequence that the AR step at the node's position
    sees, in that step's key blocks. Every block, lane and reduction is the AR step's, so a
    greedy tree reproduces AR bit for bit. q and o are [B, n, H, D] contiguous."""
    pid = tl.program_id(0)
    b = (pid // HKV).to(tl.int64)
    kvh = pid % HKV
    r = tl.arange(0, BLOCK_M)
    if TREE:
        t = (tl.program_id(1) // HB).to(tl.int64)
        g = (tl.program_id(1) % HB) * BLOCK_M + r
        valid = g < G
        h = kvh * G + g
        base = tl.load(base_ptr + b)
        row = path_ptr + (b * n + t) * PW
        steps = tl.load(row)
        hi = tl.minimum(base + steps, capacity).to(tl.int32)
        qo = (b * n + t) * (H * D) + h[:, None] * D
    else:
        m = tl.program_id(1) * BLOCK_M + r
        t = m // G
        h = kvh * G + m % G
        valid = t < n
        pos = tl.load(pos_ptr + b * n + t, mask=valid, other=-1)
        hi = tl.minimum(tl.max(pos, axis=0) + 1, capacity).to(tl.int32)
        qo = (b * n + t)[:, None] * (H * D) + h[:, None] * D
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    qo = qo + d[None, :]
    qmask = valid[:, None] & dmask[None, :]
    q = tl.load(q_ptr + qo, mask=qmask, other=0.0)
    kv = b * s_kb + kvh * s_kh
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Key blocks wholly below a tree's path read contiguous slots, as AR's do; only the blocks
    # that reach the path gather (a loop that may gather anywhere loses the vector loads).
    plain = hi
    if TREE:
        plain = tl.minimum((base // BLOCK_N) * BLOCK_N, hi).to(tl.int32)
    for start in range(0, plain, BLOCK_N):
        s = start + tl.arange(0, BLOCK_N)
        if TREE:
            seen = valid[:, None] & (s < hi)[None, :]
        else:
            seen = s[None, :] <= pos[:, None]
        m_i, l_i, acc = _attend_block(q, k_ptr, v_ptr, kv, s, s, d, dmask, hi, seen, scale,
                                      s_ks, m_i, l_i, acc, IEEE)
    if TREE:
        for start in range(plain, hi, BLOCK_N):
            s = start + tl.arange(0, BLOCK_N)
            step = s - base + 1                      # lane s holds the path's step-th node
            on = (step >= 1) & (step <= steps)
            node = tl.load(row + step, mask=on, other=0)
            slot = tl.where(on, base + node, s)
            seen = valid[:, None] & (s < hi)[None, :]
            m_i, l_i, acc = _attend_block(q, k_ptr, v_ptr, kv, s, slot, d, dmask, hi, seen,
                                          scale, s_ks, m_i, l_i, acc, IEEE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + qo, out.to(o_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def _tree_path_kernel(bits_ptr, path_ptr, NW: tl.constexpr, BLOCK_W: tl.constexpr):
    """Row r of the path table (:func:`flashspec.core.path_table`) from the NW-word ancestor mask
    bits_ptr[r]: the count of set bits, then the id of the k-th set bit at entry k."""
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_W)
    word = tl.load(bits_ptr + r * NW + j // 64, mask=j < 64 * NW, other=0)
    bit = ((word >> (j % 64).to(tl.int64)) & 1).to(tl.int32)
    rank = tl.cumsum(bit, 0)
    out = path_ptr + r * (64 * NW + 1)
    tl.store(out + rank, j, mask=bit != 0)
    tl.store(out, tl.sum(bit, 0))


@triton.jit
def _drafter_input_kernel(src_ptr, col_ptr, prev_ptr, tok_ptr, emb_ptr, wf_ptr, we_ptr, out_ptr,
                          base_ptr, ids_ptr, pos_ptr, slot_ptr, n, P, s_sb, s_sp, d, depth, eps,
                          MODE: tl.constexpr, NORM: tl.constexpr, TREE: tl.constexpr,
                          BLOCK: tl.constexpr, PB: tl.constexpr):
    """One token (b, t) of a feature-level drafter's input: [f ; e] with f a row of src [B, P, d]
    (MODE 0: column t; 1: column col_ptr[b, t]; 2: the column j where prev_ptr[b, j] equals
    col_ptr[b, t], a tree node's parent among the last expanded nodes) and e row
    tok_ptr[b, t] of the embedding table, each RMSNorm-ed (NORM, weights wf / we, rounded as
    ``_add_rmsnorm_kernel`` rounds) or cast; TREE also writes the node's RoPE position
    base[b] + depth and cache slot base[b] + ids[b, t]."""
    row = tl.program_id(0).to(tl.int64)
    b = row // n
    DT = out_ptr.dtype.element_ty
    if MODE == 0:
        col = row % n
    elif MODE == 1:
        col = tl.load(col_ptr + row)
    else:
        j = tl.arange(0, PB)
        prev = tl.load(prev_ptr + b * P + j, mask=j < P, other=-1)
        col = tl.minimum(tl.min(tl.where(prev == tl.load(col_ptr + row), j, PB), axis=0), P - 1)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    f = tl.load(src_ptr + b * s_sb + col * s_sp + cols, mask=mask, other=0.0).to(DT).to(tl.float32)
    e = tl.load(emb_ptr + tl.load(tok_ptr + row) * d + cols, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        f = _rmsnorm_row(f, wf_ptr, cols, mask, d, eps, DT)
        e = _rmsnorm_row(e, we_ptr, cols, mask, d, eps, DT)
    tl.store(out_ptr + row * (2 * d) + cols, f.to(DT), mask=mask)
    tl.store(out_ptr + row * (2 * d) + d + cols, e.to(DT), mask=mask)
    if TREE:
        base = tl.load(base_ptr + b)
        tl.store(pos_ptr + row, base + depth)
        tl.store(slot_ptr + row, base + tl.load(ids_ptr + row))


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    """out[r, i] = silu(gu[r, i]) * gu[r, inter + i], SiLU rounded to the dtype first."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    DT = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * (2 * inter) + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * (2 * inter) + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (act * u).to(DT), mask=mask)


INTERPRET = interpreted(_silu_mul_kernel)    # how the kernels were built (not a switch)


# ----------------------------------------------------------------------------- wrappers
def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual, normed): residual = x + delta (written into ``delta``'s buffer; ``x`` itself
    when delta is None), normed = RMSNorm(residual) * weight, for x, delta [..., d]."""
    d = x.shape[-1]
    x = x.contiguous()
    res = x if delta is None else delta.contiguous()
    out = torch.empty_like(x)
    block = _pow2(d)
    _add_rmsnorm_kernel[(x.numel() // d,)](x, res, res, out, weight, d, eps,
                                           HAS_DELTA=delta is not None, BLOCK=block,
                                           num_warps=4 if block <= 2048 else 8)
    return res, out


def rope_cache_write(qkv: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, inv_freq: torch.Tensor, rope_scale: float,
                     heads: int, kv_heads: int, slots: torch.Tensor | None = None) -> torch.Tensor:
    """Rotated queries [B, n, H, D] from qkv [B, n, (H + 2 H_kv) D]; rotated keys and the values
    go to ``k_cache``/``v_cache`` [B, H_kv, capacity, D] at slot = position ([B, n] int64), or
    at ``slots`` [B, n] when given."""
    b, n, width = qkv.shape
    qkv = qkv.contiguous()
    head_dim = width // (heads + 2 * kv_heads)
    q = torch.empty(b, n, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    half = head_dim // 2
    _rope_cache_kernel[(b * n,)](
        qkv, positions, positions if slots is None else slots, inv_freq, q, k_cache, v_cache, n,
        k_cache.shape[2], float(rope_scale), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2),
        H=heads, HKV=kv_heads, D=head_dim, HALF=half, BLOCK_HQ=_pow2(heads), BLOCK_HK=_pow2(kv_heads),
        BLOCK_HALF=_pow2(half), SLOTS=slots is not None, INTERPRET=INTERPRET,
        num_warps=1 if heads * head_dim <= 1024 else 4)
    return q


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     positions: torch.Tensor, block_m: int | None = None,
                     tree: TreeAttention | None = None, block_n: int | None = None,
                     warps: int = 4, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [B, n, H, D] (contiguous) over the cache [B, H_kv, capacity, D]:
    a query at position p sees slots 0..p of its own row; with ``tree``
    (:class:`flashspec.core.TreeAttention`) a node sees the committed prefix, its ancestors
    and itself, in the order and blocks of the AR step at its position (so it rounds as that
    step does). Returns [B, n, H, D]. ``block_m`` (query rows of a chain step), ``block_n`` (key
    slots) and ``warps`` per program: the launch geometry; a tree step takes the AR step's, which
    its bit-equality with AR rests on. ``out``: where to write (default a tensor like q); an
    fp32 ``out`` keeps the fp32 result of 16-bit inputs, before it is rounded."""
    b, n, heads, head_dim = q.shape
    q = q.contiguous()
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    ieee = q.dtype == torch.float32
    # An AR step is one token: its G query rows fit a 16-row block whenever G <= 64. A tree
    # node must use that same block and key block, whatever the node count.
    head_blocks = 1
    table = positions
    if tree is not None:
        block_m = AR_BLOCK_M if group <= 64 else 64
        head_blocks = triton.cdiv(group, block_m)
        grid = (b * kv_heads, n * head_blocks)
        positions, table = tree.slots, tree_path(tree)
    else:
        # chain steps of up to 64 query rows take blocks of 16 rows: more programs in flight
        # than one long program per kv head
        block_m = block_m or (AR_BLOCK_M if n * group <= 64 else 64)
        grid = (b * kv_heads, triton.cdiv(n * group, block_m))
    out = torch.empty_like(q) if out is None else out
    _decode_attention_kernel[grid](
        q, k_cache, v_cache, positions, table, positions if tree is None else tree.base, out, n,
        capacity, 1.0 / math.sqrt(head_dim), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), table.shape[-1],
        H=heads, HKV=kv_heads, G=group, D=head_dim, BLOCK_M=block_m,
        BLOCK_N=block_n or (32 if ieee else 128), BLOCK_D=max(16, _pow2(head_dim)),
        TREE=tree is not None, HB=head_blocks, IEEE=ieee, num_warps=warps)
    return out


def tree_path(tree: TreeAttention) -> torch.Tensor:
    """``tree.path`` (:func:`flashspec.core.path_table`) from one launch of
    :func:`_tree_path_kernel`, kept on ``tree`` so every layer of the step reads the same table:
    decoding the bitmask once per step instead of in every attention program."""
    table = tree.__dict__.get("path")
    if table is None:
        bits = tree.bits.contiguous()
        words = bits.shape[-1]
        table = torch.zeros(*bits.shape[:-1], 64 * words + 1, dtype=torch.int32,
                            device=bits.device)
        if table.numel():
            _tree_path_kernel[(bits.numel() // words,)](bits, table, NW=words,
                                                        BLOCK_W=64 * _pow2(words), num_warps=1)
        tree.__dict__["path"] = table
    return table


def drafter_input(src: torch.Tensor, tokens: torch.Tensor, embed: torch.Tensor,
                  norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                  cols: torch.Tensor | None = None,
                  parents: tuple[torch.Tensor, torch.Tensor] | None = None,
                  tree: tuple[torch.Tensor, int, torch.Tensor] | None = None):
    """A feature-level drafter's input [B, n, 2d] in one launch: per token (b, t), a feature row
    of ``src`` [B, P, d] (column t; column ``cols[b, t]``; or, with ``parents`` = (prev ids
    [B, P], parent ids [B, n]), the column of the token's parent among prev ids) beside row
    ``tokens[b, t]`` of ``embed`` [V, d], each RMSNorm-ed when ``norms`` = (feature weight,
    embedding weight, eps), as ``add_rmsnorm`` would. With ``tree`` = (base [B], depth, node ids
    [B, n]) returns (input, RoPE positions base + depth, cache slots base + ids) [B, n] too."""
    b, n = tokens.shape
    d = embed.shape[1]
    if src.stride(-1) != 1:
        src = src.contiguous()
    tokens = tokens.contiguous()
    out = torch.empty(b, n, 2 * d, dtype=embed.dtype, device=embed.device)
    # pointers a mode or flag leaves unread get ``tokens`` (any valid int64 buffer)
    index, prev, mode = tokens, tokens, 0
    if parents is not None:
        prev, index, mode = parents[0].contiguous(), parents[1].contiguous(), 2
    elif cols is not None:
        index, mode = cols.contiguous(), 1
    wf, we, eps = norms if norms is not None else (embed, embed, 0.0)
    base, depth, ids, pos, slots = tokens, 0, tokens, None, None
    if tree is not None:
        base, depth, ids = tree[0], tree[1], tree[2].contiguous()
        pos, slots = torch.empty_like(tokens), torch.empty_like(tokens)
    if b * n:
        _drafter_input_kernel[(b * n,)](src, index, prev, tokens, embed, wf, we, out, base, ids,
                                        tokens if pos is None else pos,
                                        tokens if slots is None else slots, n, prev.shape[1],
                                        src.stride(0), src.stride(1), d, depth, float(eps),
                                        MODE=mode, NORM=norms is not None, TREE=tree is not None,
                                        BLOCK=_pow2(d), PB=_pow2(max(prev.shape[1], 1)),
                                        num_warps=4)
    return out if tree is None else (out, pos, slots)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2I] (gate first, contiguous); returns [..., I]."""
    inter = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(_pow2(inter), 1024)
    _silu_mul_kernel[(out.numel() // inter, triton.cdiv(inter, block))](gate_up, out, inter,
                                                                       BLOCK=block, num_warps=4)
    return out


# ----------------------------------------------------------------------------- weights
def _merge(modules: Sequence[nn.Module], name: str) -> torch.Tensor | None:
    """Concatenate ``name`` (weight or bias) of ``modules`` along dim 0 and make every
    module's parameter a view into the result (no second copy of the weights)."""
    parts = [getattr(m, name) for m in modules]
    if any(p is None for p in parts):
        return None
    merged = torch.cat([p.detach() for p in parts], 0)
    offset = 0
    for module, p in zip(modules, parts):
        view = merged[offset:offset + p.shape[0]]
        setattr(module, name, nn.Parameter(view, requires_grad=p.requires_grad))
        offset += p.shape[0]
    return merged


def fusable(block: nn.Module) -> bool:
    """Whether every projection of ``block`` is a plain dense linear (not e.g. NF4)."""
    attn, mlp = block.self_attn, block.mlp
    mods = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
            mlp.down_proj)
    return all(type(m) in (Linear, nn.Linear) for m in mods)


@torch.no_grad()
def fuse_block(block: nn.Module) -> None:
    """Merge q|k|v (and their biases) and gate|up of ``block`` into single weights, stored as
    non-persistent buffers ``qkv_weight``/``qkv_bias``/``gate_up_weight`` (state dicts keep
    their keys; the original parameters become views). Call after loading and moving."""
    attn, mlp = block.self_attn, block.mlp
    qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
    attn.register_buffer("qkv_weight", _merge(qkv, "weight"), persistent=False)
    attn.register_buffer("qkv_bias", _merge(qkv, "bias"), persistent=False)
    mlp.register_buffer("gate_up_weight", _merge((mlp.gate_proj, mlp.up_proj), "weight"),
                        persistent=False)


def _aliased(merged: torch.Tensor | None, parts: Sequence[torch.Tensor]) -> bool:
    """``parts`` are still consecutive rows of ``merged`` (false after ``.to()`` or a swap)."""
    if merged is None:
        return False
    ptr, step = merged.data_ptr(), merged.stride(0) * merged.element_size()
    for p in parts:
        if p.data_ptr() != ptr or p.dtype != merged.dtype:
            return False
        ptr += p.shape[0] * step
    return True


def _merged(module: nn.Module, name: str, parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The merged weight ``name`` of ``module`` if still current, else None (separate matmuls;
    warns once when a merged weight went stale, e.g. after ``.to()``: fuse again)."""
    w = getattr(module, name, None)
    if _aliased(w, parts):
        return w
    if w is not None and name not in _warned:
        _warned.add(name)
        log.warning("merged %s no longer aliases its projections (moved or replaced after "
                    "fusing); using separate matmuls, fuse again (fuse_model / EagleModule.fuse)", name)
    return None


def _qkv(attn: nn.Module, h: torch.Tensor) -> torch.Tensor:
    w = _merged(attn, "qkv_weight", (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight))
    if w is not None:
        return linear(h, w, attn.qkv_bias)
    return torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], dim=-1)


def _gate_up(mlp: nn.Module, h: torch.Tensor) -> torch.Tensor:
    w = _merged(mlp, "gate_up_weight", (mlp.gate_proj.weight, mlp.up_proj.weight))
    if w is not None:
        return linear(h, w)
    return torch.cat([mlp.gate_proj(h), mlp.up_proj(h)], dim=-1)


# ----------------------------------------------------------------------------- layers
def usable(x: torch.Tensor, positions: torch.Tensor, cache) -> bool:
    """Whether a step may take the fused layers: cached, at most MAX_TOKENS per row, on CUDA
    (or the interpreter), without autograd, not traced by torch.compile (which fuses the
    reference layers itself): :mod:`flashspec.kernels`' ``decode_layers`` rule."""
    return choose("decode_layers", x, positions=positions, cache=cache).triton


def block_step(block: nn.Module, residual: torch.Tensor, delta: torch.Tensor | None,
               positions: torch.Tensor, cache, inv_freq: torch.Tensor, rope_scale: float,
               tree: TreeAttention | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder block on the pending residual stream ``residual + delta``; returns the new
    (residual, delta) pair (the MLP output is added by the next ``add_rmsnorm``). ``tree``: the
    tokens are draft-tree nodes (own cache slots, tree attention)."""
    attn, mlp, s = block.self_attn, block.mlp, block.self_attn.s
    b, n, _ = residual.shape
    i = cache.slot[attn.layer_id]
    residual, h = add_rmsnorm(residual, delta, block.input_layernorm.weight,
                              block.input_layernorm.eps)
    q = rope_cache_write(_qkv(attn, h), positions, cache.k[i], cache.v[i], inv_freq, rope_scale,
                         s.num_heads, s.num_kv_heads, None if tree is None else tree.slots)
    o = decode_attention(q, cache.k[i], cache.v[i], positions, tree=tree).view(b, n, -1)
    residual, h = add_rmsnorm(residual, attn.o_proj(o), block.post_attention_layernorm.weight,
                              block.post_attention_layernorm.eps)
    return residual, mlp.down_proj(silu_mul(_gate_up(mlp, h)))


def run_blocks(blocks: Sequence[nn.Module], x: torch.Tensor, positions: torch.Tensor, cache,
               inv_freq: torch.Tensor, rope_scale: float, tree: TreeAttention | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(residual, pending delta) after ``blocks`` on input states ``x`` [B, n, d] (x is not
    modified); the stream is ``residual + delta`` (delta None when there are no blocks)."""
    residual, delta = x.contiguous(), None
    positions = positions.contiguous()
    for block in blocks:
        residual, delta = block_step(block, residual, delta, positions, cache, inv_freq, rope_scale,
                                     tree)
    return residual, delta


class FusedLayers:
    """The fused decode layers as :class:`flashspec.models.llama.DecodeLayers`."""

    def usable(self, x: torch.Tensor, positions: torch.Tensor, cache) -> bool:
        return usable(x, positions, cache)

    def run(self, blocks: Sequence[nn.Module], x: torch.Tensor, positions: torch.Tensor, cache,
            inv_freq: torch.Tensor, rope_scale: float, tree: TreeAttention | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return run_blocks(blocks, x, positions, cache, inv_freq, rope_scale, tree)

    def final_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, norm: nn.Module
                   ) -> torch.Tensor:
        return add_rmsnorm(residual, delta, norm.weight, norm.eps)[1]


LAYERS = FusedLayers()


def fuse_model(model: LlamaLM, enabled: bool = True) -> LlamaLM:
    """Run ``model``'s cached steps of at most ``MAX_TOKENS`` tokens per row (AR, verify,
    drafting, prefill) through the fused decode kernels; longer ones keep the reference layers.

    Merges q|k|v and gate|up weights once (the originals become views: call after loading
    and moving the model). Quantized (NF4) layers cannot be fused: the model stays as is.
    ``fuse_model(model, False)`` switches back to the reference layers (the merged weights
    remain).
    """
    if enabled and not all(fusable(block) for block in model.layers):
        log.warning("fused decode layers need dense projections (not quantized); not fused")
        enabled = False
    if enabled:
        for block in model.layers:
            fuse_block(block)
    model.decode_layers = LAYERS if enabled else None
    return model
