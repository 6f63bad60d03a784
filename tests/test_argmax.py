"""The Triton row argmax of greedy drafting (interpreter on CPU) against ``torch.argmax``."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from flashspec.argmax import row_argmax


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
