"""The drafter's training objective: the hand-written backward of the top-k + tail
cross-entropy and of the T = 1 acceptance term against autograd on the explicit partition."""
from __future__ import annotations

import pytest
import torch

from flashspec.training.train import TailCrossEntropy


def partition_reference(x, weight, ids, logp):
    """(cross-entropy, acceptance) per row, by autograd over the explicit [M, V] softmax."""
    q = torch.softmax(x @ weight.T, -1)
    q_top = q.gather(1, ids)
    q_tail = 1 - q_top.sum(-1)
    p_top = logp.exp()
    p_tail = 1 - p_top.sum(-1)
    ce = -(p_top * q_top.log()).sum(-1) - p_tail * q_tail.log()
    accept = torch.minimum(p_top, q_top).sum(-1) + torch.minimum(p_tail, q_tail)
    return ce, accept


def problem(seed: int, m: int = 6, d: int = 5, v: int = 40, k: int = 4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g, dtype=torch.float64)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(m)])
    # the target: a random distribution whose top-k ids are ``ids`` (tail mass left over)
    p = torch.softmax(3 * torch.randn(m, v, generator=g, dtype=torch.float64), -1)
    logp = p.gather(1, ids).log()
    return x, weight, ids, logp


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("w_ce,w_accept", [(1.0, 0.0), (0.0, 1.0), (1.0, 2.5)])
def test_loss_and_acceptance_gradients_match_autograd(seed, w_ce, w_accept):
    x, weight, ids, logp = problem(seed)
    coef = torch.linspace(0.5, 1.5, x.shape[0], dtype=torch.float64)   # per-row upstream grads
    xs, ws = [x.clone().requires_grad_() for _ in range(2)], [weight.clone().requires_grad_()
                                                               for _ in range(2)]
    ce, accept, top1 = TailCrossEntropy.apply(xs[0], ws[0], ids, logp, torch.float64)
    ref_ce, ref_accept = partition_reference(xs[1], ws[1], ids, logp)
    torch.testing.assert_close(ce, ref_ce)
    torch.testing.assert_close(accept, ref_accept)
    assert torch.equal(top1, (x @ weight.T).argmax(-1))
    assert bool(((accept > 0) & (accept <= 1)).all())
    (coef * (w_ce * ce - w_accept * accept)).sum().backward()
    (coef * (w_ce * ref_ce - w_accept * ref_accept)).sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad)
    torch.testing.assert_close(ws[0].grad, ws[1].grad)


def test_acceptance_term_alone_raises_acceptance():
    """Descending on 1 - accept alone moves the drafter's distribution onto the target's: the
    acceptance of a sampled draft token climbs toward 1 (what the T = 1 recipe optimises)."""
    x, weight, ids, logp = problem(3, m=8, k=16)
    weight = weight.clone().requires_grad_()
    opt = torch.optim.Adam([weight], lr=0.05)
    first = None
    for _ in range(300):
        _, accept, _ = TailCrossEntropy.apply(x, weight, ids, logp, torch.float64)
        first = accept.mean().item() if first is None else first
        opt.zero_grad()
        (1 - accept).mean().backward()
        opt.step()
    last = TailCrossEntropy.apply(x, weight, ids, logp, torch.float64)[1].mean().item()
    assert first < 0.6 and last > first + 0.3, (first, last)
