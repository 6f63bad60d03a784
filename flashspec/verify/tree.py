"""Exact verification of a draft tree (reference): recursive rejection sampling over siblings.

Walking down from the root with w = p(· | node) (unnormalised residual masses), the node's
children are tested in their order; child x is accepted with probability min(1, p_j(x) / q_j(x))
(p_j = w / Σw; uniform of stream ``row * (N+1) + child`` at index V, in log space), and a
rejected child updates the residual (``drop_rejected``) before the next sibling is tested:

- one-hot drafts (``draft.logits`` None: children chosen deterministically, e.g. the top draft
  tokens, by a rule that does not read the verifier's random numbers): q_j = δ_x, so the
  residual max(0, p_j - δ_x) is w with x zeroed;
- sampled drafts (``draft.logits`` [B, N+1, V]: node i's children were drawn from
  q = warp(logits[i]) *without replacement*, in that order): q_j is q with the earlier siblings
  removed, and the residual is max(0, p_j - q_j); x then leaves q.

An accepted child becomes the node; when every child is rejected (or the node is a leaf) one
token is drawn from w by the two-level exponential race of the chain rule (stream
``row * (N+1) + node``): the correction, or the bonus token at a leaf. Each sibling test is a
single-draft speculative step (draft x ~ q_j, independent of the earlier tests) whose residual
is the next test's target, so the emitted token is distributed exactly as p(· | node); by
induction so is the whole path.

Greedy rows accept the first child equal to the target's argmax and emit the argmax: the
longest path matching the target's greedy continuation.
"""
from __future__ import annotations

import torch

from flashspec.core import SamplingParams, TreeDraft
from flashspec.verify import rng
from flashspec.verify.reference import block_race, row_temperatures, warp_rows
from flashspec.verify.sampling import check_finite


def drop_rejected(w: torch.Tensor, q: torch.Tensor | None, rows: torch.Tensor,
                  tokens: torch.Tensor) -> None:
    """The residual after rejecting draft ``tokens`` of ``rows`` (in place): one-hot drafts
    (q None) zero the token in w; sampled ones set w = max(0, w/Σw - q/Σq) and remove the token
    from q (the next sibling was drawn without it)."""
    if q is None:
        w[rows, tokens] = 0.0
        return
    p_j = w[rows] / w[rows].sum(-1, keepdim=True)
    q_j = q[rows] / q[rows].sum(-1, keepdim=True)
    w[rows] = torch.clamp(p_j - q_j, min=0.0)
    q[rows, tokens] = 0.0


def verify_tree(target_logits: torch.Tensor, draft: TreeDraft, params: SamplingParams,
                seed: int | torch.Tensor = 0, temperature: torch.Tensor | None = None,
                depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify trees against the target's logits [B, N + 1, V] (node i's next-token logits).

    Returns (out_tokens [B, D + 1] padded with -1, n_accepted [B], path [B, D]: the accepted
    node ids, -1 padded); D is ``depth`` (at least the deepest node: the tree shape's depth),
    or the deepest node of the batch when not given."""
    check_finite(target_logits, "target logits")
    batch, width, vocab = target_logits.shape
    dev = target_logits.device
    temps = row_temperatures(params, temperature, batch, dev)
    greedy = temps == 0
    logp = warp_rows(target_logits, params, temps)                     # [B, N+1, V]
    best = logp.argmax(-1)                                              # [B, N+1]
    kids = draft.children()                                             # [B, N+1, K]
    tokens = draft.tokens.long()
    depth = int(draft.depth.max()) if depth is None else depth
    if temperature is None and params.greedy:  # all rows greedy: no residuals, no random numbers
        return greedy_walk(best, kids, tokens, depth)
    logq = None if draft.logits is None else warp_rows(draft.logits, params, temps)
    rows, node, alive, path, out, n_acc = _walk_start(batch, depth, dev)
    streams = rows[:, None] * width + torch.arange(width, device=dev)   # [B, N+1]
    u = rng.uniform(seed, streams, torch.tensor(vocab, device=dev))     # accept test of node i
    for d in range(depth + 1):
        p = logp[rows, node].exp()                                      # [B, V]
        w = p.clone()
        q = None if logq is None else logq[rows, node].exp()
        chosen = torch.full((batch,), -1, dtype=torch.long, device=dev)
        for r in range(kids.shape[-1]):
            child = kids[rows, node, r]
            live = alive & (chosen < 0) & (child >= 0)
            if not live.any():
                break
            c = child.clamp(min=0)
            x = tokens[rows, c]
            log_px = torch.log(w[rows, x]) - torch.log(w.sum(-1))
            log_qx = (torch.zeros_like(log_px) if q is None else
                      torch.log(q[rows, x]) - torch.log(q.sum(-1)))
            ok_sampled = (log_px > -torch.inf) & (log_qx > -torch.inf) & (
                torch.log(u[rows, c]) < log_px - log_qx)
            ok = torch.where(greedy, x == best[rows, node], ok_sampled)
            chosen = torch.where(live & ok, c, chosen)
            # a child q could not have drawn (q(x) = 0: fewer tokens in q's support than
            # siblings) is rejected without touching the residual
            miss = live & ~ok & ~greedy & (log_qx > -torch.inf)
            drop_rejected(w, q, rows[miss], x[miss])
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


def greedy_walk(best: torch.Tensor, kids: torch.Tensor, tokens: torch.Tensor, depth: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Temperature 0: from the root, accept the first child whose token is the target's argmax
    ``best`` [B, N+1] at its parent, and emit the argmax where no child matches (what the
    sampled walk does for greedy rows, without its residuals and random numbers)."""
    rows, node, alive, path, out, n_acc = _walk_start(best.shape[0], depth, best.device)
    for d in range(depth + 1):
        child = kids[rows, node]                                        # [B, K]
        match = (child >= 0) & (tokens.gather(1, child.clamp(min=0)) == best[rows, node, None])
        go = alive & match.any(-1)
        chosen = child.gather(1, match.long().argmax(-1, keepdim=True)).squeeze(1)
        out[:, d] = torch.where(alive & ~go, best[rows, node], out[:, d])
        if d < depth:
            path[:, d] = torch.where(go, chosen, path[:, d])
            out[:, d] = torch.where(go, tokens.gather(1, chosen.clamp(min=0)[:, None]).squeeze(1),
                                    out[:, d])
        n_acc += go.long()
        node = torch.where(go, chosen, node)
        alive = go
    return out, n_acc, path


def _walk_start(batch: int, depth: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """A walk's state at the roots: (rows, node, alive, path [B, D], out [B, D + 1],
    n_accepted), paths and outputs -1 padded."""
    rows = torch.arange(batch, device=dev)
    node = torch.zeros(batch, dtype=torch.long, device=dev)
    alive = torch.ones(batch, dtype=torch.bool, device=dev)
    path = torch.full((batch, depth), -1, dtype=torch.long, device=dev)
    out = torch.full((batch, depth + 1), -1, dtype=torch.long, device=dev)
    return rows, node, alive, path, out, torch.zeros(batch, dtype=torch.long, device=dev)
