"""Exact verification of a draft tree (reference): recursive rejection sampling over siblings.

The drafter chose each node's children deterministically (the top draft tokens, or any rule
that does not read the verifier's random numbers), so the draft distribution of a child is
one-hot. Walking down from the root with w = p(· | node), the children are tested in priority
order: child x is accepted with probability w(x) / Σw (uniform of stream ``row * (N+1) + child``
at index V, in log space); a rejected child's token is removed from w (``drop_rejected``: the
residual max(0, w - Σw·δ_x) of a one-hot draft is w with x zeroed) and the next sibling is
tested against what is left. An accepted child becomes the node; when every child is rejected
(or the node is a leaf) one token is drawn from w by the two-level exponential race of the chain
rule (stream ``row * (N+1) + node``), which is the bonus token at a leaf. Each level is a chain
of single-draft speculative steps whose residual is the next step's target, so the emitted
token is distributed exactly as p(· | node); by induction so is the whole path.

Greedy rows accept the first child equal to the target's argmax and emit the argmax: the
longest path matching the target's greedy continuation.
"""
from __future__ import annotations

import torch

from flashspec.tree import TreeDraft
from flashspec.verify import rng
from flashspec.verify.reference import block_race, row_temperatures, warp_rows
from flashspec.verify.sampling import SamplingParams, check_finite


def drop_rejected(w: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    """The residual after rejecting the one-hot drafts ``tokens`` of ``rows``: zero them in w."""
    w[rows, tokens] = 0.0


def verify_tree(target_logits: torch.Tensor, draft: TreeDraft, params: SamplingParams,
                seed: int | torch.Tensor = 0, temperature: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify trees against the target's logits [B, N + 1, V] (node i's next-token logits).

    Returns (out_tokens [B, D + 1] padded with -1, n_accepted [B], path [B, D]: the accepted
    node ids, -1 padded), D the deepest node of the batch."""
    check_finite(target_logits, "target logits")
    batch, width, vocab = target_logits.shape
    dev = target_logits.device
    temps = row_temperatures(params, temperature, batch, dev)
    greedy = temps == 0
    logp = warp_rows(target_logits, params, temps)                     # [B, N+1, V]
    best = logp.argmax(-1)                                              # [B, N+1]
    kids = draft.children()                                             # [B, N+1, K]
    tokens = draft.tokens.long()
    depth = int(draft.depth.max())
    rows = torch.arange(batch, device=dev)
    streams = rows[:, None] * width + torch.arange(width, device=dev)   # [B, N+1]
    u = rng.uniform(seed, streams, torch.tensor(vocab, device=dev))     # accept test of node i

    node = torch.zeros(batch, dtype=torch.long, device=dev)
    alive = torch.ones(batch, dtype=torch.bool, device=dev)
    path = torch.full((batch, depth), -1, dtype=torch.long, device=dev)
    out = torch.full((batch, depth + 1), -1, dtype=torch.long, device=dev)
    n_acc = torch.zeros(batch, dtype=torch.long, device=dev)
    for d in range(depth + 1):
        p = logp[rows, node].exp()                                      # [B, V]
        w = p.clone()
        chosen = torch.full((batch,), -1, dtype=torch.long, device=dev)
        for r in range(kids.shape[-1]):
            child = kids[rows, node, r]
            live = alive & (chosen < 0) & (child >= 0)
            if not live.any():
                break
            c = child.clamp(min=0)
            x = tokens[rows, c]
            wx = w[rows, x]
            ok_sampled = (wx > 0) & (torch.log(u[rows, c]) < torch.log(wx) - torch.log(w.sum(-1)))
            ok = torch.where(greedy, x == best[rows, node], ok_sampled)
            chosen = torch.where(live & ok, c, chosen)
            miss = live & ~ok & ~greedy
            drop_rejected(w, rows[miss], x[miss])
        stop = alive & (chosen < 0)
        if stop.any():
            fix = block_race(w, p, seed, streams[rows, node])
            fix = torch.where(greedy, best[rows, node], fix)
            out[stop, d] = fix[stop]
        go = alive & (chosen >= 0)
        if d < depth:
            path[go, d] = chosen[go]
            out[go, d] = tokens[rows, chosen.clamp(min=0)][go]
        n_acc += go.long()
        node = torch.where(go, chosen, node)
        alive = go
    return out, n_acc, path
