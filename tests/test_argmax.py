"""The Triton row argmax and Gumbel-max draws of drafting (interpreter on CPU) against
``torch.argmax`` and the torch form of the counter-based draw."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings, strategies as st
from scipy import stats as sps

from flashspec.core import SamplingParams
from flashspec.verify.argmax import gumbel_argmax, row_argmax, row_topk
from flashspec.verify.sampling import gumbel_draw, inverse_temperature


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 3), vocab=st.integers(1, 3000), levels=st.integers(1, 5),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**16), neg_inf=st.booleans())
def test_row_argmax_equals_torch_first_index_of_the_max(rows, vocab, levels, dtype, seed,
                                                         neg_inf):
    """Few distinct values make ties common: the first index of the max wins, as in torch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, vocab), generator=g).to(dtype)
    if neg_inf:
        x[0] = -torch.inf
    assert torch.equal(row_argmax(x), x.argmax(-1))


def test_row_argmax_keeps_leading_shape_and_stays_in_range():
    x = torch.randn(2, 3, 49152)
    assert torch.equal(row_argmax(x), x.argmax(-1))
    x[0, 0, 7] = torch.nan
    assert 0 <= int(row_argmax(x)[0, 0]) < 49152


def test_row_argmax_of_no_rows():
    assert row_argmax(torch.zeros(0, 10)).shape == (0,)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 3), vocab=st.integers(2, 2500), seed=st.integers(0, 2**40),
       step=st.integers(0, 7), temperature=st.sampled_from([0.3, 0.7, 1.0, 1.9]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_gumbel_kernel_draws_the_torch_paths_tokens(rows, vocab, seed, step, temperature, dtype):
    """Same uniforms, same float32 operations: the kernel's draw is the torch path's token."""
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed % 997)) * 3
              ).to(dtype)
    s = torch.tensor(seed)
    want = gumbel_draw(logits, SamplingParams(temperature=temperature), s, step)
    assert torch.equal(gumbel_argmax(logits, inverse_temperature(temperature), s, step), want)


def test_gumbel_draws_follow_the_softmax_and_a_planted_bug_fails():
    """χ² of 4,000 draws (4,000 rows, one seed) against softmax(x / T), on the torch form of
    the draw (the kernel's tokens equal it, above; the interpreter would run 4,000 programs);
    the same draws without the temperature (a planted bug) fail the same test."""
    vocab, n, t = 12, 4000, 0.6
    x = torch.linspace(-2.0, 2.0, vocab)
    probs = torch.softmax(x / t, -1).numpy()
    logits = x.expand(n, vocab).contiguous()

    def p_value(temperature: float) -> float:
        tokens = gumbel_draw(logits, SamplingParams(temperature=temperature), torch.tensor(11), 0)
        counts = np.bincount(tokens.numpy(), minlength=vocab)
        return float(sps.chisquare(counts, probs * n).pvalue)

    assert p_value(t) > 1e-3
    assert p_value(1.0) < 1e-6


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 3), vocab=st.integers(8, 9000), k=st.integers(1, 8),
       levels=st.sampled_from([3, 1000]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_row_topk_equals_log_softmax_topk(rows, vocab, k, levels, dtype, seed):
    """The k largest entries in decreasing order, ties to the smaller column (few levels make
    ties common), with their log-probabilities under softmax, across several blocks."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randint(0, levels, (rows, vocab), generator=g).float() / 7).to(dtype)
    tok, lp = row_topk(x, k)
    ref = torch.log_softmax(x.float(), dim=-1)
    order = sorted(range(vocab), key=lambda j: (-float(x[0, j]), j))[:k]   # ties: smaller column
    assert tok[0].tolist() == order
    for r in range(rows):
        assert torch.equal(x[r, tok[r]], x[r].topk(k).values)
        torch.testing.assert_close(lp[r], ref[r, tok[r]], rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 3), vocab=st.integers(8, 9000), k=st.integers(1, 6),
       temperature=st.sampled_from([0.4, 1.0, 1.7]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**40))
def test_gumbel_topk_kernel_draws_pick_childrens_tokens(rows, vocab, k, temperature, dtype, seed):
    """row_topk with a seed draws pick_children's torch-form children (same counter-based
    uniforms, same float32 keys), in draw order, with log q at the drawn tokens."""
    from flashspec.tree import pick_children
    g = torch.Generator().manual_seed(seed % 9973)
    x = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    s = torch.tensor(seed)
    streams = torch.arange(rows) * 1024 + 5
    params = SamplingParams(temperature=temperature)
    want_tok, want_lp = pick_children(x, k, params, None, s, streams)
    tok, lp = row_topk(x, k, inverse_temperature(temperature), s, streams)
    assert torch.equal(tok, want_tok)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-4)


def test_gumbel_topk_draws_without_replacement_and_a_planted_bug_fails():
    """The first two of k = 2 Gumbel top-k draws over 4,000 streams against the law of two
    draws without replacement from softmax(x / T) (χ² over ordered pairs); the same keys
    without the temperature (a planted bug) fail. Torch form (the kernel equals it, above)."""
    from flashspec.tree import pick_children
    vocab, n, t = 6, 4000, 0.6
    x = torch.linspace(-1.5, 1.5, vocab)
    p = torch.softmax(x / t, -1)
    pairs = p[:, None] * p[None, :] / (1 - p[:, None])            # P(first i, then j)
    pairs.fill_diagonal_(0)
    logits = x.expand(n, vocab).contiguous()

    def p_value(temperature: float) -> float:
        tok, _ = pick_children(logits, 2, SamplingParams(temperature=temperature), None,
                               torch.tensor(17), torch.arange(n))
        assert (tok[:, 0] != tok[:, 1]).all()
        counts = np.bincount((tok[:, 0] * vocab + tok[:, 1]).numpy(), minlength=vocab * vocab)
        law = pairs.flatten().double().numpy()
        keep = law > 0
        return float(sps.chisquare(counts[keep], law[keep] / law[keep].sum() * n).pvalue)

    assert p_value(t) > 1e-3
    assert p_value(1.0) < 1e-6
