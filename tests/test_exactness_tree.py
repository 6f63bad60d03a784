"""Statistical exactness gate for tree verification (recursive rejection over siblings).

Same statistics as tests/test_exactness_gate.py (per-position two-sample KS vs plain target
samples and χ² vs the exact warped probabilities, family-wise α = 0.01), over 10,000 rows of
multi-step static-tree speculation on context-free tables (tests/exactness/tree_harness.py).
The fused Triton kernel (flashspec.verify.triton_tree) passes the same gate at T = 1 with
one-hot and sampled siblings (it fuses temperature only; warps fall back to the reference).
Power: the same gate fails when the sibling residual update is planted wrong (a rejected
sibling's token stays in the residual) and when the bonus token ignores the accepted node.

Dynamic trees (EAGLE-2's growth and choice of nodes, :func:`flashspec.tree.grow_tree`) pass
the same gate with sampled siblings. They fail it when a drawn sibling is ranked by its own
draft probability (EAGLE-2's score, which the product uses only when greedy): that keeps
likely-looking draws and biases the output toward them.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from exactness.stats import exact_target_probs, gate, sample_reference  # noqa: E402
from exactness.tables import make_draft, make_target  # noqa: E402
from exactness.tree_harness import (dynamic_tree_speculative_sample,  # noqa: E402
                                    repeated_sibling_speculative_sample,
                                    tree_speculative_sample)
from flashspec.core import SamplingParams, TreeDraft  # noqa: E402
import flashspec.tree as tree_growth  # noqa: E402
from flashspec.verify import tree as tree_verify  # noqa: E402
from test_triton_tree import make_tree_case  # noqa: E402

N_ROWS, LENGTH, VOCAB = 10_000, 5, 256
CASES = [  # (temperature, top_k, top_p, branching, draft overlap, sampled siblings with full q)
    (1.0, 0, 1.0, (3, 2, 1), 0.9, False),
    (0.7, 20, 1.0, (4, 2), 0.8, False),
    (1.5, 0, 0.9, (2, 2, 2), 0.95, False),
    (1.0, 0, 1.0, (3, 2, 1), 0.9, True),
    (0.7, 20, 0.9, (4, 2), 0.8, True),
]


def run_tree_gate(temperature, top_k, top_p, branching, overlap, full_q, verify_fn, seed=0):
    target, z = make_target(VOCAB, LENGTH + len(branching) + 2, seed=seed)
    draft = make_draft(z, overlap, seed=seed + 1)
    params = SamplingParams(temperature, top_k, top_p)
    run = tree_speculative_sample(target, draft, branching, params, N_ROWS, LENGTH, verify_fn,
                                  seed, full_q)
    probs = exact_target_probs(target[:LENGTH], temperature, top_k, top_p)
    return gate(run.tokens, sample_reference(probs, N_ROWS, seed + 12345), probs), run


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-k{c[1]}-p{c[2]}-{'x'.join(map(str, c[3]))}"
                                                   f"-{'q' if c[5] else '1hot'}")
def test_tree_gate_passes(case) -> None:
    result, run = run_tree_gate(*case, tree_verify.verify_tree)
    print(f"\n[tree gate] {case}: alpha={run.alpha:.3f} tau={1 + run.accepted / run.calls / N_ROWS:.2f} "
          f"{result.summary()}")
    assert 0 < run.alpha < 1
    assert result.passed, result.summary()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=["1hot", "q"])
def test_tree_gate_passes_on_the_triton_kernel(case) -> None:
    """The fused kernel (interpreted on CPU) under the same gate: temperature is all it fuses."""
    from flashspec.verify import triton_tree
    assert triton_tree.INTERPRET or torch.cuda.is_available()
    result, run = run_tree_gate(*case, triton_tree.verify_tree)
    print(f"\n[tree gate, triton] {case}: {result.summary()}")
    assert 0 < run.alpha < 1
    assert result.passed, result.summary()


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=["1hot", "q"])
def test_tree_gate_fails_when_rejected_siblings_stay_in_the_residual(monkeypatch, case) -> None:
    """Planted bug: the residual after a rejected sibling is not updated (its token keeps its
    mass, so later siblings are tested against the wrong distribution and the correction token
    can repeat a rejected one)."""
    monkeypatch.setattr(tree_verify, "drop_rejected", lambda w, q, rows, tokens: None)
    result, run = run_tree_gate(*case, tree_verify.verify_tree)
    print(f"\n[tree gate] planted sibling-residual bug: {result.summary()}")
    assert not result.passed, result.summary()


@pytest.mark.parametrize("planted", [False, True], ids=["exact", "planted"])
def test_tree_gate_with_repeated_one_hot_siblings(monkeypatch, planted) -> None:
    """An n-gram draft tree may repeat a sibling's token (branches padded with the row's last
    token). A repeated one-hot sibling, tested after its twin was rejected, meets a residual
    without its token and is rejected, so the output keeps the target's distribution (T = 1,
    3 branches x 3 deep, half the rows repeating). With the sibling-residual update planted
    away, the twin is tested against the target again and the gate fails."""
    if planted:
        monkeypatch.setattr(tree_verify, "drop_rejected", lambda w, q, rows, tokens: None)
    target, z = make_target(VOCAB, LENGTH + 5, seed=4)
    draft = make_draft(z, 0.9, seed=5)
    params = SamplingParams(1.0)
    run = repeated_sibling_speculative_sample(target, draft, 3, 3, params, N_ROWS, LENGTH,
                                              tree_verify.verify_tree, seed=4)
    probs = exact_target_probs(target[:LENGTH], 1.0)
    result = gate(run.tokens, sample_reference(probs, N_ROWS, 4 + 12345), probs)
    print(f"\n[tree gate] repeated one-hot siblings, planted={planted}: {result.summary()}")
    assert 0 < run.alpha < 1
    assert result.passed != planted, result.summary()


DYNAMIC = [(1.0, "dyn15d6k4", 0.8), (1.0, "dyn5d4k3", 0.8), (0.7, "dyn6d3k3", 0.9)]


def run_dynamic_gate(temperature, spec, overlap, seed=2):
    target, z = make_target(VOCAB, LENGTH + 12, seed=seed)
    draft = make_draft(z, overlap, seed=seed + 1)
    params = SamplingParams(temperature)
    run = dynamic_tree_speculative_sample(target, draft, spec, params, N_ROWS, LENGTH,
                                          tree_verify.verify_tree, seed)
    probs = exact_target_probs(target[:LENGTH], temperature)
    return gate(run.tokens, sample_reference(probs, N_ROWS, seed + 12345), probs), run


@pytest.mark.parametrize("case", DYNAMIC, ids=lambda c: f"T{c[0]}-{c[1]}")
def test_dynamic_tree_gate_passes(case) -> None:
    result, run = run_dynamic_gate(*case)
    print(f"\n[dynamic tree gate] {case}: alpha={run.alpha:.3f} {result.summary()}")
    assert 0 < run.alpha < 1
    assert result.passed, result.summary()


@pytest.mark.parametrize("case", DYNAMIC[:2], ids=lambda c: f"T{c[0]}-{c[1]}")
def test_dynamic_tree_gate_fails_when_draws_are_ranked_by_their_own_probability(monkeypatch,
                                                                                case) -> None:
    """Planted bug (what this code did before): a sampled dynamic tree ranks each drawn node
    by its own cumulative draft log-probability, as EAGLE-2 does when greedy."""
    real = tree_growth._grow_depth
    monkeypatch.setattr(tree_growth, "_grow_depth",
                        lambda *args, path=None, **kw: real(*args, **kw))
    result, _ = run_dynamic_gate(*case)
    print(f"\n[dynamic tree gate] planted own-score rank: {result.summary()}")
    assert not result.passed, result.summary()


def test_tree_gate_fails_when_the_bonus_ignores_the_path(monkeypatch) -> None:
    """Planted bug: the correction/bonus token is drawn from the root's distribution."""
    real = tree_verify.block_race

    def root_race(w, p, seed, streams):
        return real(p[:1].expand_as(p).contiguous(), p, seed, streams)
    monkeypatch.setattr(tree_verify, "block_race", root_race)
    result, _ = run_tree_gate(*CASES[0], tree_verify.verify_tree)
    assert not result.passed, result.summary()


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 5), nodes=st.integers(1, 14),
       vocab=st.sampled_from([16, 50]), full_q=st.booleans(), ties=st.booleans())
def test_greedy_walk_equals_the_sampled_walk_at_temperature_zero(seed, batch, nodes, vocab,
                                                                 full_q, ties) -> None:
    """``verify_tree`` with every row greedy takes a shortcut (no residuals, no random numbers):
    the same tokens, counts and paths as the general walk given per-row temperatures of 0, on
    random trees whose children often carry the argmax (and, with ``ties``, logits with ties)."""
    gen = torch.Generator().manual_seed(seed)
    target, draft = make_tree_case(gen, batch, nodes, vocab, 0.0, full_q, torch.float32, 0.0)
    if ties:
        target = target.round()
    params = SamplingParams()
    fast = tree_verify.verify_tree(target, draft, params, seed)
    walk = tree_verify.verify_tree(target, draft, params, seed, torch.zeros(batch))
    for name, a, b in zip(("out", "n_accepted", "path"), fast, walk):
        assert torch.equal(a, b), f"{name}: {a.tolist()} vs {b.tolist()}"


def test_greedy_tree_accepts_the_longest_argmax_path() -> None:
    """Temperature 0: the path follows the target's argmax through the tree, then the argmax."""
    gen = torch.Generator().manual_seed(0)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3]])
    depth = torch.tensor([[0, 1, 1, 2, 2, 2, 3]])
    logits = torch.randn(1, 7, 50, generator=gen)
    best = logits.argmax(-1)[0]
    tokens = torch.tensor([[9, (best[0] + 1) % 50, best[0], best[2], (best[2] + 3) % 50, 5, 7]])
    out, n_acc, path = tree_verify.verify_tree(logits, TreeDraft(tokens, parents, depth),
                                               SamplingParams())
    # node 2 (= argmax of root) accepted; its children: only node 5 -> token 5
    expect_path = [2] + ([5] if int(best[2]) == 5 else [])
    assert path[0, :len(expect_path)].tolist() == expect_path
    assert int(n_acc[0]) == len(expect_path)
    assert out[0, len(expect_path)] == best[expect_path[-1]]
