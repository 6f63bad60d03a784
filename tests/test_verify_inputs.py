"""What a caller hands the public verify entries is checked once, before any backend (issue 45).

Each case below was silent or a traceback: out-of-range drafts in greedy rows accepted (the CPU
triton backend fell back to the reference before its own checks), out-of-range drafts at T = 1
(an index error), drafts of the wrong length, a NaN per-row temperature, a batch or vocabulary
mismatch, 2-D logits. Now each is one line naming the argument. Valid inputs give exactly what
the backend gives unchecked.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported anywhere

import pytest
import torch

from flashspec.core import Arm, SamplingParams, TreeDraft
from flashspec.engine import SpecEngine
from flashspec.errors import FlashSpecError
from flashspec.models.llama import LlamaLM, LlamaShape
from flashspec.verify import get_backend, verify, verify_tree

BACKENDS = ["torch", "triton"]
GREEDY, SAMPLED = SamplingParams(0.0), SamplingParams(1.0)
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning")]


def chain(batch: int = 3, gamma: int = 2, vocab: int = 11, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, gamma + 1, vocab, generator=gen)
    q = torch.randn(batch, gamma, vocab, generator=gen)
    drafts = torch.randint(0, vocab, (batch, gamma), generator=gen)
    return x, drafts, q


def tree(batch: int = 2, vocab: int = 11, seed: int = 0):
    """Target logits [B, 4, V] and a one-hot draft of the tree 0 -> (1, 2), 1 -> 3."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, vocab, generator=gen)
    tokens = torch.randint(0, vocab, (batch, 4), generator=gen)
    parents = torch.tensor([-1, 0, 0, 1]).expand(batch, -1).clone()
    depth = torch.tensor([0, 1, 1, 2]).expand(batch, -1).clone()
    return x, TreeDraft(tokens, parents, depth, None)


# ----------------------------------------------------------------------------- chains
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "T=1"])
@pytest.mark.parametrize("bad", [11, -1])
def test_out_of_range_drafts_raise(backend, params, bad):
    x, drafts, q = chain()
    drafts[1, 1] = bad
    with pytest.raises(FlashSpecError, match=rf"draft_tokens\[1, 1\] = {bad} .*\[0, 11\)"):
        verify(x, drafts, q, params, 0, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_shapes_raise_one_line(backend):
    x, drafts, q = chain()
    cases = [
        ((x, drafts[:, :1], q), r"target_logits \(3, 3, 11\) does not match draft_tokens"),
        ((x, drafts[:2], None), r"does not match draft_tokens \(2, 2\)"),      # batch
        ((x, drafts, q[..., :10]), r"draft_logits \(3, 2, 10\) must be \[B, γ, V\]"),   # vocab
        ((x, drafts, q[:2]), r"draft_logits \(2, 2, 11\)"),
        ((x[:, 0], drafts, None), r"expected target_logits \[B, γ\+1, V\].*\(3, 11\)"),  # 2-D
        ((x, drafts[0], None), r"draft_tokens \[B, γ\], got .* and \(2,\)"),
        ((x[..., :0], drafts, None), r"no vocabulary"),
    ]
    for args, message in cases:
        with pytest.raises(FlashSpecError, match=message):
            verify(*args, SAMPLED, 0, backend=backend)


def test_triton_backend_checks_shapes_before_falling_back():
    """Called unchecked, the triton backend still refuses a shape mismatch on a path it hands
    to the reference (top-p) instead of the reference's traceback."""
    x, drafts, q = chain()
    with pytest.raises(FlashSpecError, match="does not match draft_tokens"):
        get_backend("triton").verify(x, drafts[:, :1], q, SamplingParams(1.0, top_p=0.9), 0)


def test_wrong_types_and_dtypes_raise():
    x, drafts, q = chain()
    with pytest.raises(TypeError, match="draft_tokens must have an integer dtype, got torch.float32"):
        verify(x, drafts.float(), q, SAMPLED)
    with pytest.raises(TypeError, match="target_logits must have a floating dtype, got torch.int64"):
        verify(x.long(), drafts, q, SAMPLED)
    with pytest.raises(TypeError, match="draft_logits must be a torch.Tensor, got list"):
        verify(x, drafts, q.tolist(), SAMPLED)
    with pytest.raises(TypeError, match="params must be flashspec.verify.SamplingParams, got dict"):
        verify(x, drafts, q, {"temperature": 1.0})
    with pytest.raises(TypeError, match="seed must be an int"):
        verify(x, drafts, q, SAMPLED, seed=1.5)
    with pytest.raises(TypeError, match="seed must be an int.*shape \\(2,\\)"):
        verify(x, drafts, q, SAMPLED, seed=torch.tensor([1, 2]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value,message", [
    (float("nan"), r"temperature\[1\] must be 0 \(greedy\) or a finite number >= 0.0001, got nan"),
    (float("inf"), r"temperature\[1\] .* got inf"),
    (-0.5, r"temperature\[1\] .* got -0.5"),
    (1e-6, r"temperature\[1\] .* got 1e-06"),
])
def test_bad_row_temperatures_raise(backend, value, message):
    x, drafts, q = chain()
    temps = torch.tensor([1.0, value, 0.0], dtype=torch.float64)
    with pytest.raises(FlashSpecError, match=message):
        verify(x, drafts, q, SAMPLED, 0, backend=backend, temperature=temps)


def test_row_temperature_shape_and_type():
    x, drafts, q = chain()
    with pytest.raises(FlashSpecError, match=r"one value per row: 3, got shape \(2,\)"):
        verify(x, drafts, q, SAMPLED, temperature=torch.ones(2))
    with pytest.raises(TypeError, match="temperature must be a tensor .* got float"):
        verify(x, drafts, q, SAMPLED, temperature=0.7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["target", "draft"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_and_inf_logits_raise(backend, where, value):
    """DESIGN.md: NaN/inf logits raise, never emit tokens, whichever backend (the triton one
    on CUDA only poisons rows: the public entry raises before it runs)."""
    x, drafts, q = chain()
    (x if where == "target" else q)[2, 1, 4] = value
    with pytest.raises(FloatingPointError, match="NaN or \\+inf"):
        verify(x, drafts, q, GREEDY, 0, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_neg_inf_row_raises(backend):
    x, drafts, q = chain()
    x[0, 2] = float("-inf")
    with pytest.raises(FloatingPointError, match=r"target_logits\[0, 2\] is all -inf"):
        verify(x, drafts, q, SAMPLED, 0, backend=backend)


def test_devices_must_agree():
    x, drafts, q = chain()
    with pytest.raises(FlashSpecError, match="draft_tokens is on meta but target_logits on cpu"):
        verify(x, drafts.to("meta"), q, SAMPLED)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("params", [GREEDY, SAMPLED, SamplingParams(0.7, top_k=3)],
                         ids=["greedy", "T=1", "top-k"])
def test_valid_inputs_give_the_backends_answer(backend, params):
    x, drafts, q = chain(batch=4, seed=3)
    x[0, 1, :5] = float("-inf")                               # -inf is a legal mask value
    temps = torch.tensor([0.0, 1.0, 0.5, 2.0])
    for seed in (5, torch.tensor(5)):
        for t in (None, temps):
            want = get_backend(backend).verify(x, drafts, q, params, seed, temperature=t)
            got = verify(x, drafts, q, params, seed, backend=backend, temperature=t)
            assert all(torch.equal(a, b) for a, b in zip(want, got))
    empty = verify(x[:, :1], drafts[:, :0], None, params, 1, backend=backend)   # γ = 0
    assert empty[0].shape == (4, 1) and (empty[1] == 0).all()


# ----------------------------------------------------------------------------- trees
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "T=1"])
def test_tree_valid_inputs_give_the_backends_answer(backend, params):
    x, draft = tree()
    want = get_backend(backend).verify_tree(x, draft, params, 4, depth=3)
    got = verify_tree(x, draft, params, 4, backend=backend, depth=3)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def bad_tree(kind: str):
    x, d = tree()
    tokens, parents, depth, logits = d.tokens, d.parents, d.depth, d.logits
    if kind == "token":
        tokens = tokens.clone()
        tokens[1, 2] = 11
    elif kind == "negative token":
        tokens = tokens.clone()
        tokens[0, 3] = -1
    elif kind == "root":
        parents = parents.clone()
        parents[1, 0] = 0
    elif kind == "forward parent":
        parents = parents.clone()
        parents[0, 2] = 3
    elif kind == "depth":
        depth = depth.clone()
        depth[1, 3] = 1
    elif kind == "shape":
        parents = parents[:, :3]
    elif kind == "draft logits":
        logits = torch.randn(2, 4, 10)
    elif kind == "nan":
        x[1, 3, 0] = float("nan")
    return x, TreeDraft(tokens, parents, depth, logits)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,error,message", [
    ("token", FlashSpecError, r"draft.tokens\[1, 2\] = 11 is not a token id in \[0, 11\)"),
    ("negative token", FlashSpecError, r"draft.tokens\[0, 3\] = -1"),
    ("root", FlashSpecError, r"draft row 1: node 0 must be the root .* got parent 0"),
    ("forward parent", FlashSpecError, r"draft.parents\[0, 2\] = 3: a node's parent must be"),
    ("depth", FlashSpecError, r"draft.depth\[1, 3\] = 1: must be its parent's depth \+ 1 = 2"),
    ("shape", FlashSpecError, r"draft parents \(2, 3\) does not match target_logits"),
    ("draft logits", FlashSpecError, r"draft logits \(2, 4, 10\) must be \[B, N \+ 1, V\]"),
    ("nan", FloatingPointError, r"target_logits contain NaN"),
])
def test_bad_trees_raise_one_line(backend, kind, error, message):
    x, draft = bad_tree(kind)
    with pytest.raises(error, match=message):
        verify_tree(x, draft, SAMPLED, 0, backend=backend)


def test_tree_depth_and_draft_type():
    x, draft = tree()
    with pytest.raises(FlashSpecError, match=r"depth must be an integer >= the deepest node \(2\), got 1"):
        verify_tree(x, draft, SAMPLED, depth=1)
    with pytest.raises(TypeError, match="draft must be a flashspec.core.TreeDraft, got tuple"):
        verify_tree(x, (draft.tokens, draft.parents), SAMPLED)
    with pytest.raises(TypeError, match="draft.parents must have an integer dtype"):
        verify_tree(x, TreeDraft(draft.tokens, draft.parents.float(), draft.depth), SAMPLED)


# ----------------------------------------------------------------------------- engine
def test_engine_params_must_be_sampling_params():
    shape = LlamaShape(vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=4, max_positions=32)
    model = LlamaLM(shape, 1.0 / 10000.0 ** (torch.arange(0, 4, 2).float() / 4))
    with pytest.raises(TypeError, match=r"params must be flashspec.verify.SamplingParams, got "
                                        r"dict.*SamplingParams\(\*\*d\)"):
        SpecEngine(model, [Arm()], params={"temperature": 0.7})
    SpecEngine(model, [Arm()], params=SamplingParams(0.7))          # the right type
