"""Multi-step tree speculative sampling over context-free tables (the tree rule's gate).

Each step every active row drafts a static tree: a node at depth d - 1 gets ``branching[d-1]``
children drawn without replacement from the draft table at the row's position + d - 1 (Gumbel
top-k with a generator the verifier never sees). ``full_q`` False: they are drawn from the
unwarped table and handed over as one-hot drafts (a proposal that is deterministic from the
verifier's point of view, different per node and per row); True: drawn from q = warp(table)
and the table rows go to verify as each node's draft logits (the sampled-sibling rule). Node
i's target logits are the table row at position + depth(i). Verify accepts a path and emits
one more token.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from exactness.harness import SpecRun
from flashspec.core import SamplingParams, TreeDraft
from flashspec.verify import rng
from flashspec.verify.sampling import warp_logprobs


def static_tree(branching: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """(parents, depth) of the N + 1 nodes of a static tree, breadth first."""
    parents, depth, frontier = [-1], [0], [0]
    for d, k in enumerate(branching, start=1):
        nxt = []
        for node in frontier:
            for _ in range(k):
                parents.append(node)
                depth.append(d)
                nxt.append(len(parents) - 1)
        frontier = nxt
    return parents, depth


def draw_children(draft: torch.Tensor, pos: torch.Tensor, parents: list[int], depth: list[int],
                  gen: torch.Generator, params: SamplingParams | None = None) -> torch.Tensor:
    """Node tokens [R, N + 1]: siblings distinct, drawn ∝ the draft table (warped by
    ``params`` when given) without replacement, in draw order."""
    rows, width = pos.shape[0], len(parents)
    tokens = torch.zeros(rows, width, dtype=torch.long)
    logq = torch.log_softmax(draft.float(), -1) if params is None else warp_logprobs(draft, params)
    for parent in sorted(set(parents[1:])):
        kids = [i for i in range(width) if parents[i] == parent]
        at = pos + depth[kids[0]] - 1                                      # [R]
        gumbel = -torch.log(-torch.log(torch.rand(rows, draft.shape[-1], generator=gen)))
        top = (logq[at] + gumbel).topk(len(kids), dim=-1).indices
        tokens[:, kids] = top
    return tokens


def tree_speculative_sample(target: torch.Tensor, draft: torch.Tensor,
                            branching: tuple[int, ...], params: SamplingParams, n_rows: int,
                            length: int, verify_fn, seed: int, full_q: bool = False) -> SpecRun:
    """Tokens [N, length] of ragged multi-step tree speculation with ``verify_fn``."""
    parents, depth = static_tree(branching)
    gen = torch.Generator().manual_seed(seed + 99)
    par = torch.tensor(parents).expand(n_rows, -1)
    dep = torch.tensor(depth).expand(n_rows, -1)

    def draft_tree(pos: torch.Tensor) -> TreeDraft:
        at = pos[:, None] + dep[:len(pos)]
        return TreeDraft(draw_children(draft, pos, parents, depth, gen, params if full_q else None),
                         par[:len(pos)], dep[:len(pos)], draft[at] if full_q else None)
    return _speculate(target, draft_tree, len(branching), params, n_rows, length, verify_fn, seed)


def repeated_sibling_speculative_sample(target: torch.Tensor, draft: torch.Tensor,
                                        branches: int, depth: int, params: SamplingParams,
                                        n_rows: int, length: int, verify_fn, seed: int) -> SpecRun:
    """As :func:`tree_speculative_sample` for one-hot trees of ``branches`` chains (the shape
    of an n-gram draft tree, :func:`flashspec.drafters.ngram.branch_tree`), where on half the
    rows every later branch repeats the first branch's tokens (n-gram branches padded with the
    row's last token repeat one another)."""
    branching = (branches,) + (1,) * (depth - 1)
    parents, dep = static_tree(branching)
    gen = torch.Generator().manual_seed(seed + 99)
    par, d = torch.tensor(parents), torch.tensor(dep)
    nodes = torch.arange(1, len(parents))

    def draft_tree(pos: torch.Tensor) -> TreeDraft:
        tokens = draw_children(draft, pos, parents, dep, gen)
        twin = torch.rand(len(pos), generator=gen) < 0.5
        first = 1 + (nodes - 1) // branches * branches          # branch 0's node at that depth
        tokens[:, 1:] = torch.where(twin[:, None], tokens[:, first], tokens[:, 1:])
        return TreeDraft(tokens, par.expand(len(pos), -1), d.expand(len(pos), -1))
    return _speculate(target, draft_tree, depth, params, n_rows, length, verify_fn, seed)


def tree_positions_needed(length: int, branching: tuple[int, ...]) -> int:
    return length + len(branching) + 1


def n_nodes(branching: tuple[int, ...]) -> int:
    return sum(math.prod(branching[:d + 1]) for d in range(len(branching)))


def dynamic_tree_speculative_sample(target: torch.Tensor, draft: torch.Tensor, spec: str,
                                    params: SamplingParams, n_rows: int, length: int,
                                    verify_fn, seed: int) -> SpecRun:
    """As :func:`tree_speculative_sample` with a dynamic tree grown by
    :func:`flashspec.tree.grow_tree` (the product's growth and choice of nodes): the drafter
    at depth d reads the draft table at the row's position + d, children are drawn without
    replacement from q = warp(table) (torch generator), and their draft logits go to verify."""
    from flashspec.core import TreeShape
    from flashspec.tree import grow_tree
    shape = TreeShape.parse(spec)
    gen = torch.Generator().manual_seed(seed + 99)

    def draft_tree(pos: torch.Tensor) -> TreeDraft:
        def expand(ids, toks, parents, d, bits):
            return draft[(pos + d)[:, None].expand_as(ids)]
        return grow_tree(draft[pos], torch.zeros_like(pos), shape, expand, params, gen,
                         fused=False)
    return _speculate(target, draft_tree, shape.max_depth, params, n_rows, length, verify_fn,
                      seed)


def _speculate(target: torch.Tensor, draft_tree, max_depth: int, params: SamplingParams,
               n_rows: int, length: int, verify_fn, seed: int) -> SpecRun:
    """The multi-step loop: each step, ``draft_tree(positions of the active rows)`` drafts,
    node i is scored by the target table at position + depth(i), ``verify_fn`` accepts a path
    and one more token, and the rows advance."""
    lengths = torch.zeros(n_rows, dtype=torch.long)
    run = SpecRun(tokens=np.full((n_rows, length), -1, dtype=np.int64))
    while (rows := (lengths < length).nonzero().squeeze(1)).numel():
        pos = lengths[rows]
        tree = draft_tree(pos)
        out, n_acc, _ = verify_fn(target[pos[:, None] + tree.depth], tree, params,
                                  rng.call_seed(seed, run.calls))
        run.calls += 1
        j = torch.arange(out.shape[1])[None]
        at = pos[:, None] + j
        keep = (j <= n_acc[:, None]) & (at < length)
        r = rows[:, None].expand_as(at)[keep].numpy()
        run.tokens[r, at[keep].numpy()] = out[keep].numpy()
        lengths[rows] += n_acc + 1
        run.proposed += max_depth * len(rows)
        run.accepted += int(n_acc.sum())
    return run
