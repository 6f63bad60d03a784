"""Fused Triton tree verify vs the tree reference, on CPU under TRITON_INTERPRET=1.

Same seed -> identical tokens, counts and paths. Trees, logits, temperatures (per row, greedy
rows mixed in), dtypes, -inf masks, seed kinds and one-hot vs sampled siblings are drawn by
Hypothesis from a seeded generator. The statistical gate of tests/test_exactness_tree.py runs
on the fused kernel too (10,000 rows at T = 1, one-hot and sampled siblings). On a GPU machine,
`TRITON_INTERPRET=0 pytest tests/test_triton_tree.py` compares compiled kernels on CUDA tensors.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported anywhere

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from exactness.tree_harness import static_tree
from flashspec.core import SamplingParams, TreeDraft
from flashspec.verify import get_backend
from flashspec.verify import tree as reference_tree
from flashspec.verify import triton_tree

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning")]
np.seterr(all="ignore")          # log(0) = -inf etc. inside the interpreter is intended
DEVICE = torch.device("cuda" if not triton_tree.INTERPRET and torch.cuda.is_available() else "cpu")


def test_runs_in_interpreter():
    """Guard: without the interpreter every CPU call would fall back to the reference."""
    assert triton_tree.INTERPRET or DEVICE.type == "cuda"


def random_tree(gen: torch.Generator, batch: int, nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(parents, depth) [B, N + 1] of random topological trees (parent of i uniform in 0..i-1)."""
    parents = torch.full((batch, nodes + 1), -1, dtype=torch.long)
    depth = torch.zeros(batch, nodes + 1, dtype=torch.long)
    for i in range(1, nodes + 1):
        parents[:, i] = torch.randint(0, i, (batch,), generator=gen)
        depth[:, i] = depth.gather(1, parents[:, i:i + 1])[:, 0] + 1
    return parents, depth


def make_tree_case(gen: torch.Generator, batch: int, nodes: int, vocab: int, temp: float,
                   full_q: bool, dtype: torch.dtype, neg_inf: float, static: tuple | None = None,
                   scale: float = 2.0):
    """Target logits [B, N+1, V] and a draft whose siblings are distinct draws (Gumbel top-k)
    from the draft distribution at their parent, so paths are accepted and rejected."""
    if static is not None:
        par, dep = static_tree(static)
        parents, depth = torch.tensor(par).expand(batch, -1), torch.tensor(dep).expand(batch, -1)
    else:
        parents, depth = random_tree(gen, batch, nodes)
    width = parents.shape[1]
    x = torch.randn(batch, width, vocab, generator=gen) * scale
    if neg_inf > 0:
        x[torch.rand(x.shape, generator=gen) < neg_inf] = float("-inf")
        x[..., 0] = 0.0
    q = x + torch.randn(batch, width, vocab, generator=gen) * 0.7
    tokens = torch.zeros(batch, width, dtype=torch.long)
    keys = q / max(temp, 0.3) - torch.log(-torch.log(torch.rand(q.shape, generator=gen)))
    for b in range(batch):
        for node in range(width):
            kids = (parents[b] == node).nonzero().squeeze(1)
            if kids.numel():
                tokens[b, kids] = keys[b, node].topk(kids.numel()).indices
    draft = TreeDraft(tokens, parents.contiguous(), depth.contiguous(),
                      q.to(dtype) if full_q else None)
    return x.to(dtype), draft


def assert_same(target, draft, params, seed, temperature=None, depth=None):
    want = reference_tree.verify_tree(target, draft, params, seed, temperature, depth)
    got = triton_tree.verify_tree(target.to(DEVICE), to(draft, DEVICE), params, seed,
                                  None if temperature is None else temperature.to(DEVICE), depth)
    for name, w, g in zip(("out", "n_accepted", "path"), want, got):
        assert torch.equal(w, g.cpu()), f"{name}: reference {w.tolist()} vs triton {g.tolist()}"
    return want


def to(draft: TreeDraft, device: torch.device) -> TreeDraft:
    return TreeDraft(draft.tokens.to(device), draft.parents.to(device), draft.depth.to(device),
                     None if draft.logits is None else draft.logits.to(device))


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), nodes=st.integers(1, 12),
       vocab=st.sampled_from([7, 50, 300]), temp=st.sampled_from([0.0, 0.6, 1.0, 1.8]),
       full_q=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       neg_inf=st.sampled_from([0.0, 0.3]), row_temps=st.booleans(), tensor_seed=st.booleans())
def test_triton_tree_matches_reference(seed, batch, nodes, vocab, temp, full_q, dtype, neg_inf,
                                       row_temps, tensor_seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    target, draft = make_tree_case(gen, batch, nodes, vocab, temp, full_q, dtype, neg_inf)
    temperature = None
    if row_temps:     # greedy and sampled rows mixed in one call
        temperature = torch.tensor([0.0, 1.0, 0.7, 1.5, 0.0, 0.4][:batch])
    call_seed = torch.tensor(seed % 1000) if tensor_seed else seed % 1000
    assert_same(target, draft, SamplingParams(temperature=temp), call_seed, temperature)


@pytest.mark.parametrize("full_q", [False, True], ids=["1hot", "q"])
def test_triton_tree_matches_reference_across_race_blocks(full_q) -> None:
    """V = 3000: three race blocks, the winning block read again; a fixed depth pads output."""
    gen = torch.Generator().manual_seed(3)
    target, draft = make_tree_case(gen, 8, 0, 3000, 1.0, full_q, torch.float32, 0.0, (3, 2, 1),
                                   scale=5.0)
    out, n_acc, path = assert_same(target, draft, SamplingParams(temperature=1.0), 11, depth=5)
    assert out.shape == (8, 6) and path.shape == (8, 5)
    assert 0 < int(n_acc.sum()) < 3 * 8


@pytest.mark.parametrize("splits", [2, 3])
def test_triton_tree_split_statistics_match_reference(splits) -> None:
    """The GPU's layout: the statistics pass and the residual masses of rejected sampled
    siblings with each node's vocabulary over several programs (merged by the next launch),
    the race one block a program. Same walk as the reference: greedy rows (the argmax may lie
    in any split), sampled rows with q, and a NaN in the last split of one row poisons that
    row only."""
    gen = torch.Generator().manual_seed(5)
    target, draft = make_tree_case(gen, 6, 0, 3000, 1.0, True, torch.float32, 0.0, (3, 2, 1),
                                   scale=5.0)
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.7, 1.0, 0.0])
    want = reference_tree.verify_tree(target, draft, SamplingParams(temperature=1.0), 7,
                                      temperature, 3)
    dev = to(draft, DEVICE)
    got = triton_tree.launch(target.to(DEVICE), dev, SamplingParams(temperature=1.0), 7,
                             temperature.to(DEVICE), 3, splits=splits)
    assert {int(a) // 1024 for a in target[temperature == 0.0, 0].argmax(-1)} != {0}
    for name, w, g in zip(("out", "n_accepted", "path"), want, got):
        assert torch.equal(w, g.cpu()), f"{name}: reference {w.tolist()} vs triton {g.tolist()}"
    target[2, 0, 2990] = float("nan")
    out, n_acc, _ = triton_tree.launch(target.to(DEVICE), dev, SamplingParams(temperature=1.0),
                                       7, temperature.to(DEVICE), 3, splits=splits)
    assert n_acc.cpu().tolist()[2] == -1 and (n_acc.cpu() >= 0).sum() == 5


@pytest.mark.parametrize("full_q", [True, False], ids=["q", "1hot"])
def test_triton_tree_gpu_layout_matches_reference(full_q) -> None:
    """Many rows of wide nodes under the GPU's layout: every sibling after a rejection is
    tested against the residual mass merged from three column spans, so a merge that drops a
    span, or a state written before another program read it, changes some rows' walks."""
    gen = torch.Generator().manual_seed(11)
    target, draft = make_tree_case(gen, 96, 0, 2500, 1.0, full_q, torch.float32, 0.0, (4, 3),
                                   scale=4.0)
    want = reference_tree.verify_tree(target, draft, SamplingParams(temperature=1.0), 3)
    got = triton_tree.launch(target.to(DEVICE), to(draft, DEVICE),
                             SamplingParams(temperature=1.0), 3, None, 2, splits=3)
    for name, w, g in zip(("out", "n_accepted", "path"), want, got):
        assert torch.equal(w, g.cpu()), f"{name}: reference {w.tolist()} vs triton {g.tolist()}"
    assert (want[1] == 0).any() and (want[1] == 2).any()


def test_triton_tree_poisons_bad_rows() -> None:
    """NaN logits: CPU tensors raise like the reference; CUDA marks the row (n_accepted -1, all
    tokens -1) without a host sync and leaves the other rows alone."""
    gen = torch.Generator().manual_seed(1)
    target, draft = make_tree_case(gen, 2, 4, 50, 1.0, True, torch.float32, 0.0)
    bad = target.clone()
    bad[1, 2, 7] = float("nan")
    if DEVICE.type == "cpu":
        with pytest.raises(FloatingPointError):
            triton_tree.verify_tree(bad, draft, SamplingParams(1.0), 0)
        return
    out, n_acc, _ = triton_tree.verify_tree(bad.to(DEVICE), to(draft, DEVICE),
                                            SamplingParams(1.0), 0)
    assert n_acc.tolist()[1] == -1 and (out[1] == -1).all() and n_acc.tolist()[0] >= 0


def test_triton_tree_falls_back_to_the_reference_for_top_k(caplog) -> None:
    gen = torch.Generator().manual_seed(2)
    target, draft = make_tree_case(gen, 3, 6, 50, 0.8, True, torch.float32, 0.0)
    params = SamplingParams(temperature=0.8, top_k=10)
    with caplog.at_level("WARNING", logger="flashspec.verify.triton"):
        assert_same(target, draft, params, 5)


def test_backends_carry_their_tree_verify() -> None:
    assert get_backend("torch").verify_tree is reference_tree.verify_tree
    assert get_backend("triton").verify_tree is triton_tree.verify_tree
