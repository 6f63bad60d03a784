"""Draft trees: growing them, where their nodes sit in a target step, and moving the accepted
path into place (the tree types themselves, :class:`~flashspec.core.TreeShape`,
:class:`~flashspec.core.TreeDraft` and :class:`~flashspec.core.TreeAttention`, live in
:mod:`flashspec.core`, which models and verifiers import instead of this module).

A tree draft of row b is ``N + 1`` nodes: node 0 is the root (the row's last committed token,
fed to the target as in a chain step) and nodes 1..N are drafted tokens; ``parents[b, i] < i``
(topological order) and siblings come in the drafter's priority order. In the target's step the
node i sits at RoPE position ``L - 1 + depth[i]`` and in cache slot ``L - 1 + i`` (L the row's
committed length), attends the committed prefix and its own ancestors, and after verification
the accepted path's K/V entries move to slots ``L .. L + n - 1`` (no recomputation).

Two shapes (:class:`TreeShape`): a static one (``4x2x1``: every node at depth d gets ``k_d``
children: the top draft tokens when greedy, draws without replacement when sampling) and a
dynamic one (``dyn15``: EAGLE-2's expansion, the top-k
nodes of each depth by cumulative draft log-probability are expanded, then the N best nodes of
everything drafted are kept; under sampling a drawn node is ranked only by what was known before
its draw, see :func:`grow_tree`).
"""
from __future__ import annotations

from typing import Callable

import torch

from flashspec.core import (NODE_STREAMS, pack_bits, SamplingParams, TreeAttention, TreeDraft,
                            TreeShape)
from flashspec.kernels import choose
from flashspec.verify.sampling import mask_warps, inverse_temperature


def tree_positions(draft: TreeDraft, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(RoPE positions, cache slots) [B, N + 1] of the nodes of rows whose root sits at slot
    ``base`` [B] (committed lengths - 1)."""
    slots = base[:, None] + torch.arange(draft.tokens.shape[1], device=base.device)
    return base[:, None] + draft.depth, slots


def own_bits(start: int, count: int, words: int, device) -> torch.Tensor:
    """[count, words] int64: the single bit of each node id start .. start + count - 1."""
    ids = torch.arange(start, start + count, device=device)
    one = torch.ones(count, dtype=torch.long, device=device) << (ids % 64)
    return torch.where(torch.arange(words, device=device) == (ids // 64)[:, None], one[:, None], 0)


def tree_attention(draft: TreeDraft, lengths: torch.Tensor, span: int
                   ) -> tuple[torch.Tensor, TreeAttention]:
    """(RoPE positions [B, N + 1], :class:`TreeAttention`) of a target step over ``draft``."""
    base = lengths - 1
    positions, slots = tree_positions(draft, base)
    return positions, TreeAttention(slots, draft.ancestor_bits(), lengths, span, base)


def compact_path(cache, hidden: torch.Tensor, path: torch.Tensor, lengths: torch.Tensor,
                 fused: bool | None = None) -> torch.Tensor:
    """After a tree step of rows with committed ``lengths`` [B]: move the K/V of the accepted
    nodes ``path`` [B, D] (-1 padded) from their own slots L - 1 + id to slots L .. L + D - 1 of
    ``cache`` (a :class:`flashspec.models.llama.KVCache`; unaccepted slots copy onto
    themselves), and return the hidden states [B, D + 1, d] of the root and the path (the
    root's where the path stops) out of the step's ``hidden`` [B, N + 1, d]. ``fused``
    (default: on a GPU, :mod:`flashspec.kernels`' ``tree_compaction``): all of it in one Triton
    launch (:func:`flashspec.tree_kernels.compact`)."""
    if choose("tree_compaction", hidden, force=fused).triton:
        from flashspec.tree_kernels import compact
        return compact(cache.k, cache.v, hidden, path, lengths)
    return _compact(cache, hidden, path, lengths)


def _compact(cache, hidden: torch.Tensor, path: torch.Tensor, lengths: torch.Tensor
             ) -> torch.Tensor:
    """The torch form of :func:`compact_path`."""
    dst = lengths[:, None] + torch.arange(path.shape[1], device=path.device)
    cache.move(torch.where(path >= 0, lengths[:, None] - 1 + path, dst), dst)
    cols = torch.cat([torch.zeros_like(path[:, :1]), path.clamp(min=0)], dim=1)
    return hidden.gather(1, cols[..., None].expand(-1, -1, hidden.shape[-1]))


Expand = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]


def pick_children(logits: torch.Tensor, k: int, params: SamplingParams,
                  generator: torch.Generator | None, seed: torch.Tensor | None = None,
                  streams: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, log q) [..., k] of the children of nodes with raw draft ``logits`` [..., V]:
    greedy, the top k tokens (one-hot drafts; ties to the smaller token id); sampling, k draws
    without replacement from q = warp(logits) by Gumbel top-k (the keys' order is the order of
    sequential draws). The uniforms come from ``generator``, or, with a device ``seed``, from
    the counter-based streams ``streams`` [...] (one per node; no torch RNG state, so a CUDA
    graph can replay the draw with a new seed). On a GPU, greedy and counter-based draws with
    temperature only run as :func:`flashspec.verify.argmax.row_topk` (two kernels, the same draws;
    :mod:`flashspec.kernels`' ``topk``)."""
    if choose("topk", logits, params=params, seed=seed).triton:
        from flashspec.verify.argmax import row_topk
        if params.greedy:
            return row_topk(logits, k)
        return row_topk(logits, k, inverse_temperature(params.temperature), seed, streams)
    return _pick_children(logits, k, params, generator, seed, streams)


def _pick_children(logits: torch.Tensor, k: int, params: SamplingParams,
                   generator: torch.Generator | None, seed: torch.Tensor | None = None,
                   streams: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch form of :func:`pick_children` (any warp, a generator or a device seed)."""
    if params.greedy:
        lp, tok = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        return tok, lp
    x = mask_warps(logits.float() * inverse_temperature(params.temperature), params)
    if seed is None:
        u = torch.rand(x.shape, generator=generator, device=x.device).clamp_(min=1e-20)
    else:
        from flashspec.verify import rng
        u = rng.uniform(seed, streams[..., None], torch.arange(x.shape[-1], device=x.device))
    tok = (x - torch.log(-torch.log(u))).topk(k, dim=-1).indices
    return tok, torch.log_softmax(x, dim=-1).gather(-1, tok)


def grow_tree(root_logits: torch.Tensor, root_tokens: torch.Tensor, shape: TreeShape,
              expand: Expand, params: SamplingParams = SamplingParams(),
              generator: torch.Generator | None = None, seed: torch.Tensor | None = None,
              fused: bool | None = None) -> TreeDraft:
    """Draft a tree per row from the root's raw draft logits [B, V].

    Each depth, every frontier node gets children (:func:`pick_children`; static: ``k_d`` of
    them; dynamic: ``top_k``, and only the ``top_k`` new nodes of highest cumulative draft
    log-probability form the next frontier, best first, ties to the earlier node).
    ``expand(ids [B, f], tokens [B, f], parents [B, f], depth, bits [B, f, W]) -> raw logits
    [B, f, V]`` runs the drafter on new frontier nodes (candidate ids 1..M in drafting order,
    siblings consecutive; id 0 is the root; ``bits``: their ancestor bitmasks over candidate
    ids, as :class:`TreeAttention` takes them). A dynamic tree then keeps its ``nodes`` best
    candidates, renumbered in drafting order. The kept set is closed under ancestors and under
    earlier siblings (a sampled sibling was drawn without the ones before it): a node's rank is
    never above its parent's or an earlier sibling's; ties go to the earlier node.

    The rank that chooses nodes (the frontier and the final ``nodes``): greedy, EAGLE-2's
    cumulative draft log-probability of the node itself (the tree is a function of the prefix,
    so any choice is exact). Sampling, it must not look at the node's own draw: verification
    tests sibling k only when siblings 1..k-1 were rejected, and keeping a drawn sibling for a
    high draft probability of its own token biases the output toward such tokens (the dynamic
    tree gate in tests/test_exactness_tree.py fails that way). So a sampled dynamic tree ranks
    the k-th child of v by what is known before it is drawn: v's cumulative log q plus the log
    of the draft mass its earlier siblings left, ``log(1 - q(c_1) - ... - q(c_{k-1}))``; v's
    own cumulative score still ranks v's children. ``fused`` (default: on a GPU,
    :mod:`flashspec.kernels`' ``tree_growth``): the bookkeeping of each depth and the final
    choice run as single Triton kernels (:mod:`flashspec.tree_kernels`), with the same result."""
    batch, dev = root_logits.shape[0], root_logits.device
    fused = choose("tree_growth", root_logits, force=fused).triton
    m = shape.candidates
    rows = torch.arange(batch, device=dev)[:, None]
    words = -(-(m + 1) // 64)
    if fused:      # every node's row is written by a depth's kernel (the root's by the first)
        from flashspec.tree_kernels import grow_depth
        new = lambda *size, dtype=torch.long: torch.empty(*size, dtype=dtype, device=dev)
        tokens, parents, depth = new(batch, m + 1), new(batch, m + 1), new(batch, m + 1)
        score, bits = new(batch, m + 1, dtype=torch.float32), new(batch, m + 1, words)
    else:
        grow_depth = _grow_depth
        tokens = torch.zeros(batch, m + 1, dtype=torch.long, device=dev)
        parents = torch.full((batch, m + 1), -1, dtype=torch.long, device=dev)
        depth = torch.zeros(batch, m + 1, dtype=torch.long, device=dev)
        score = torch.zeros(batch, m + 1, device=dev)
        bits = torch.zeros(batch, m + 1, words, dtype=torch.long, device=dev)
        bits[..., 0] = 1                                               # every node: the root
        tokens[:, 0] = root_tokens
    sampled = not params.greedy
    # a sampled dynamic tree: the drawn nodes' own cumulative log q, apart from their rank
    path = (torch.zeros(batch, m + 1, device=dev) if sampled and shape.nodes else None)
    raw = (torch.zeros(batch, m + 1, root_logits.shape[-1], dtype=root_logits.dtype, device=dev)
           if sampled else None)
    frontier = (torch.zeros(batch, 1, dtype=torch.long, device=dev)
                if sampled or not fused else None)   # the fused first depth reads no frontier
    logits, used = root_logits[:, None], 1
    for d in range(1, shape.max_depth + 1):
        if raw is not None:
            raw[rows, frontier] = logits
        k = shape.branching[d - 1] if shape.branching else shape.top_k
        streams = None if params.greedy else rows * NODE_STREAMS + frontier
        tok, lp = pick_children(logits, k, params, generator, seed, streams)  # [B, f, k]
        n_new = tok[0].numel()
        nxt = shape.top_k if shape.nodes and n_new > shape.top_k else n_new
        first = {"root": root_tokens} if fused and d == 1 else {}   # the kernel writes it
        frontier, f_tok, f_par, f_bits = grow_depth(tok, lp, frontier, tokens, parents, depth,
                                                    score, bits, used, d, nxt, path=path,
                                                    **first)
        used += n_new
        if d < shape.max_depth:
            logits = expand(frontier, f_tok, f_par, d, f_bits)
    if not shape.nodes:
        return TreeDraft(tokens, parents, depth, raw, bits=bits, fanout=max(shape.branching))
    if fused:      # the selection takes the growth's form (tree_selection: the same rule)
        from flashspec.tree_kernels import keep_best
    else:
        keep_best = _keep_best
    keep, k_tok, k_par, k_depth, k_bits = keep_best(tokens, parents, depth, score, shape.nodes)
    return TreeDraft(k_tok, k_par, k_depth, None if raw is None else raw[rows, keep], bits=k_bits,
                     fanout=shape.top_k)


def _grow_depth(tok: torch.Tensor, lp: torch.Tensor, frontier: torch.Tensor,
                tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                score: torch.Tensor, bits: torch.Tensor, used: int, d: int, nxt: int,
                path: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Record the children ``tok``, ``lp`` [B, f, k] of ``frontier`` [B, f] as nodes
    ``used .. used + f k - 1`` at depth ``d`` (in place: tokens, parents, depth, score, bits),
    and return the next frontier (ids, tokens, parents, bits): its ``nxt`` best new nodes.
    ``score`` is the rank; ``path`` (sampled dynamic trees, see :func:`grow_tree`), when given,
    the nodes' own cumulative log q, and the rank then looks only at earlier siblings' draws."""
    batch, f, k = tok.shape
    rows = torch.arange(batch, device=tok.device)[:, None]
    n_new = f * k
    new = slice(used, used + n_new)
    par = frontier[:, :, None].expand(-1, -1, k).reshape(batch, -1)
    tokens[:, new] = tok.reshape(batch, -1)
    parents[:, new] = par
    depth[:, new] = d
    above = score[rows, frontier][..., None]                           # the parents' ranks
    if path is None:
        own = above + lp.float()
    else:
        mine = path[rows, frontier][..., None]
        q = lp.float().exp()
        before = torch.zeros_like(q)            # the earlier siblings' q, summed first to last
        for j in range(1, q.shape[-1]):
            before[..., j] = before[..., j - 1] + q[..., j - 1]
        own = torch.minimum(above, mine + torch.log((1 - before).clamp(min=0)))
        path[:, new] = (mine + lp.float()).reshape(batch, -1)
    score[:, new] = torch.cummin(own, dim=-1).values.reshape(batch, -1)
    bits[:, new] = bits[rows, par] | own_bits(used, n_new, bits.shape[-1], tok.device)
    ids = torch.arange(used, used + n_new, device=tok.device).expand(batch, -1)
    if nxt < n_new:
        best = torch.sort(score[:, new], dim=1, descending=True, stable=True).indices[:, :nxt]
        ids = ids.gather(1, best)
    return ids, tokens.gather(1, ids), parents.gather(1, ids), bits[rows, ids]


def _keep_best(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
               score: torch.Tensor, nodes: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dynamic tree's ``nodes`` best candidates by score (ties to the earlier), renumbered in
    drafting order: (kept ids [B, N + 1], tokens, parents, depth, ancestor bits)."""
    batch, m1 = tokens.shape
    dev = tokens.device
    rows = torch.arange(batch, device=dev)[:, None]
    order = torch.sort(score[:, 1:], dim=1, descending=True, stable=True).indices[:, :nodes] + 1
    keep = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=dev),
                      order.sort(dim=1).values], dim=1)                     # [B, N+1], drafting order
    renumber = torch.full((batch, m1), -1, dtype=torch.long, device=dev)
    renumber[rows, keep] = torch.arange(nodes + 1, device=dev)
    kept_parents = parents.gather(1, keep)
    new_parents = torch.where(kept_parents >= 0, renumber.gather(1, kept_parents.clamp(min=0)),
                              kept_parents)
    kept = TreeDraft(tokens.gather(1, keep), new_parents, depth.gather(1, keep))
    return keep, kept.tokens, kept.parents, kept.depth, pack_bits(kept.ancestors())
