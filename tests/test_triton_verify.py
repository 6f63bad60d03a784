"""Fused Triton verify vs the PyTorch reference, on CPU under TRITON_INTERPRET=1.

Same seed -> identical tokens and counts. Inputs are drawn by Hypothesis (shapes, temperature,
dtype, scale, masks, top-k, seed kinds) from a seeded torch generator, so shrinking stays cheap.
On a GPU machine, `TRITON_INTERPRET=0 FLASHSPEC_TRITON_EXAMPLES=20 pytest tests/test_triton_verify.py`
runs the same comparisons with compiled kernels on CUDA tensors.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported anywhere

import logging

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from flashspec.core import SamplingParams
from flashspec.options import KernelOptions
from flashspec.verify import get_backend, reference, rng
from flashspec.verify import triton_backend as tb
from flashspec.verify import triton_host
from flashspec.verify import triton_kernels as K

import triton
import triton.language as tl

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning")]
np.seterr(all="ignore")          # log(0) = -inf etc. inside the interpreter is intended
DEVICE = torch.device("cuda" if not tb.INTERPRET and torch.cuda.is_available() else "cpu")
TEMPS = [0.0, 0.5, 1.0, 1.7]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_runs_in_interpreter():
    """Guard: if triton was imported before TRITON_INTERPRET=1, every CPU call would fall back
    to the reference and the comparisons below would compare the reference with itself."""
    assert tb.INTERPRET or DEVICE.type == "cuda", (
        "flashspec.verify.triton_kernels was imported without TRITON_INTERPRET=1")


def make_case(gen: torch.Generator, batch: int, gamma: int, vocab: int, temp: float,
              full_q: bool, dtype: torch.dtype, scale: float, neg_inf: float,
              zero_p_draft: bool):
    """Target/draft logits and draft tokens sampled (mostly) from the draft distribution."""
    x = torch.randn(batch, gamma + 1, vocab, generator=gen) * scale
    if neg_inf > 0:
        x[torch.rand(x.shape, generator=gen) < neg_inf] = float("-inf")
        x[..., 0] = 0.0                                  # every row keeps some mass
    q = None
    if full_q:
        q = x[:, :gamma] + torch.randn(batch, gamma, vocab, generator=gen) * scale * 0.5
        q = torch.where(torch.isneginf(q) & (torch.rand(q.shape, generator=gen) < 0.5),
                        torch.zeros_like(q), q)
    src = (q if full_q else x[:, :gamma]) / max(temp, 0.3)
    probs = torch.softmax(torch.nan_to_num(src, neginf=-1e30), -1).reshape(-1, vocab)
    drafts = torch.multinomial(probs, 1, generator=gen).reshape(batch, gamma)
    drafts[:, 0] = torch.where(torch.rand(batch, generator=gen) < 0.3,
                               torch.randint(0, vocab, (batch,), generator=gen), drafts[:, 0])
    if zero_p_draft:                                     # a draft token the target gives p = 0
        x[0, 0, drafts[0, 0]] = float("-inf")
        x[0, 0, (drafts[0, 0] + 1) % vocab] = 0.0
    return (x.to(DEVICE, dtype), drafts.to(DEVICE),
            None if q is None else q.to(DEVICE, dtype))


def assert_same(x, drafts, q, params, seed, temperature=None, fused=None):
    ref_out, ref_n = reference.verify(x, drafts, q, params, seed, temperature=temperature)
    if fused is None:
        out, n = tb.verify(x, drafts, q, params, seed, temperature=temperature)
    else:
        out, n = tb.launch(x, drafts, q, params, seed, temperature=temperature, fused=fused)
    bad = (ref_out != out).any(1).nonzero().flatten().tolist()
    assert torch.equal(ref_n, n) and not bad, (
        f"rows {bad}: ref n={ref_n[bad].tolist()} out={ref_out[bad].tolist()} | "
        f"triton n={n[bad].tolist()} out={out[bad].tolist()}")
    assert out.dtype == ref_out.dtype and n.dtype == ref_n.dtype
    return ref_n


@settings(max_examples=int(os.environ.get("FLASHSPEC_TRITON_EXAMPLES", 80)), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 64), gamma=st.integers(1, 8), vocab=st.integers(2, 700),
       temp=st.sampled_from(TEMPS), full_q=st.booleans(), dtype=st.sampled_from(DTYPES),
       scale=st.sampled_from([0.1, 1.0, 4.0, 30.0]), neg_inf=st.sampled_from([0.0, 0.0, 0.4]),
       top_k=st.sampled_from([0, 0, 0, 1, 7, 40]), row_temp=st.booleans(),
       zero_p=st.booleans(), seed=st.integers(-2**40, 2**40), seed_tensor=st.booleans(),
       data_seed=st.integers(0, 2**31 - 1))
def test_matches_reference(batch, gamma, vocab, temp, full_q, dtype, scale, neg_inf, top_k,
                           row_temp, zero_p, seed, seed_tensor, data_seed):
    gen = torch.Generator().manual_seed(data_seed)
    x, drafts, q = make_case(gen, batch, gamma, vocab, temp, full_q, dtype, scale, neg_inf,
                             zero_p)
    temps = None
    if row_temp:
        temps = torch.tensor(TEMPS, dtype=torch.float64)[torch.randint(0, 4, (batch,),
                                                                        generator=gen)]
        temps = temps.to(DEVICE)
    s = torch.tensor(seed, dtype=torch.int64, device=DEVICE) if seed_tensor else seed
    assert_same(x, drafts, q, SamplingParams(temperature=temp, top_k=top_k), s, temps)


@pytest.mark.parametrize("vocab,full_q,temp,top_k", [
    (32000, True, 1.0, 0), (32771, False, 0.5, 0), (50257, True, 1.7, 20), (32000, True, 0.0, 0),
])
def test_large_vocab(vocab, full_q, temp, top_k):
    gen = torch.Generator().manual_seed(vocab)
    x, drafts, q = make_case(gen, 3, 2, vocab, temp, full_q, torch.bfloat16, 3.0, 0.0, False)
    assert_same(x, drafts, q, SamplingParams(temperature=temp, top_k=top_k), 12345)


def test_many_rows_accept_and_reject():
    """Enough rows that accepts, rejections and bonus tokens all occur, with identical counts."""
    gen = torch.Generator().manual_seed(7)
    x, drafts, q = make_case(gen, 64, 4, 257, 1.0, True, torch.float32, 1.0, 0.0, False)
    n = assert_same(x, drafts, q, SamplingParams(temperature=1.0), 99)
    assert (n == 0).any() and (n == 4).any() and ((n > 0) & (n < 4)).any()


@pytest.mark.parametrize("fused", [True, False])
def test_fused_and_separate_merges_agree(fused):
    gen = torch.Generator().manual_seed(3)
    x, drafts, q = make_case(gen, 9, 3, 300, 1.0, True, torch.bfloat16, 2.0, 0.2, False)
    assert_same(x, drafts, q, SamplingParams(temperature=1.0, top_k=5), 5, fused=fused)


def test_small_gpu_geometry_in_interpreter():
    """The GPU plan (one row per program, several chunks and race blocks) gives the same answers."""
    gen = torch.Generator().manual_seed(11)
    x, drafts, q = make_case(gen, 3, 2, 3000, 1.0, True, torch.bfloat16, 3.0, 0.1, False)
    plan = tb.Plan(rows=1, chunk=1024, rchunk=1024, warps=4, rwarps=4)
    for params in (SamplingParams(1.0), SamplingParams(0.0), SamplingParams(1.0, top_k=9)):
        ref = reference.verify(x, drafts, q, params, 8)
        got = tb.launch(x, drafts, q, params, 8, geometry=plan)
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


def test_extreme_logits():
    """Huge magnitudes, one-hot targets and -inf everywhere but a few tokens."""
    x = torch.full((4, 3, 50), float("-inf"))
    x[0, :, 3] = 0.0                                     # one-hot target
    x[1, :, :5] = torch.tensor([1e38, -1e38, 1e30, 0.0, -1e30])
    x[2] = torch.randn(3, 50) * 1e4
    x[3, :, 7:9] = torch.tensor([1e-30, 0.0])
    drafts = torch.tensor([[3, 4], [0, 2], [1, 1], [8, 7]], device=DEVICE)
    x = x.to(DEVICE)
    for temp in TEMPS:
        assert_same(x, drafts, None, SamplingParams(temperature=temp), 1)
        assert_same(x.bfloat16(), drafts, x[:, :2].flip(-1), SamplingParams(temperature=temp), 2)


def test_empty_residual_falls_back_to_p():
    """q >= p everywhere p > 0 (up to rounding) leaves an empty residual: sample from p."""
    x = torch.tensor([[[0.0, -200.0], [0.0, 0.0]]], device=DEVICE)
    q = torch.tensor([[[0.0, -199.0]]], device=DEVICE)
    drafts = torch.tensor([[1]], device=DEVICE)
    seen = set()
    for seed in range(16):
        n = assert_same(x, drafts, q, SamplingParams(temperature=1.0), seed)
        out, _ = tb.verify(x, drafts, q, SamplingParams(temperature=1.0), seed)
        seen.add((int(n), int(out[0, 0])))
    assert (0, 0) in seen                                # rejected, residual empty -> token 0


def test_greedy_is_target_argmax():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 4, 120, generator=gen).to(DEVICE)
    drafts = x[:, :3].argmax(-1)
    drafts[1, 1] = (drafts[1, 1] + 1) % 120
    out, n = tb.verify(x, drafts, None, SamplingParams(temperature=0.0), 0)
    assert n.tolist() == [3, 1, 3, 3, 3, 3]
    assert torch.equal(out[0], x[0].argmax(-1)) and out[1, :2].tolist() == [
        int(x[1, 0].argmax()), int(x[1, 1].argmax())] and out[1, 2:].tolist() == [-1, -1]


@pytest.mark.parametrize("seed", [0, -1, 2**32 + 5, 2**63 - 1, "t77", "t1099511627779"])
def test_seed_kinds(seed):
    if isinstance(seed, str):                            # 0-d and 1-element device tensors
        value = int(seed[1:])
        seed = torch.tensor(value if value < 100 else [value], device=DEVICE)
    gen = torch.Generator().manual_seed(1)
    x, drafts, q = make_case(gen, 5, 3, 90, 1.0, True, torch.float32, 2.0, 0.0, False)
    assert_same(x, drafts, q, SamplingParams(temperature=1.0), seed)


@pytest.mark.parametrize("wide", [True, False])
def test_rng_port_bit_exact(wide):
    """The Triton hash (uint32 and uint64 forms) reproduces rng.uniform bit for bit."""
    @triton.jit
    def kern(out, seed, WIDE: tl.constexpr, N: tl.constexpr):
        idx = tl.arange(0, N)
        key = K._stream_key(K._load_seed(out, seed, False), idx // 64, WIDE)
        tl.store(out + idx, K._uniform(key, idx * 977 + 3, WIDE))

    for seed in (0, 123456789, -7):
        got = torch.empty(256, device=DEVICE)
        kern[(1,)](got, seed, WIDE=wide, N=256)
        idx = torch.arange(256, device=DEVICE)
        want = rng.uniform(seed, idx // 64, idx * 977 + 3)
        assert torch.equal(got, want)


@pytest.mark.parametrize("bad", ["nan", "posinf", "neg_temp", "token"])
def test_invalid_input_raises_on_cpu_and_poisons_rows(bad):
    gen = torch.Generator().manual_seed(2)
    x, drafts, q = make_case(gen, 4, 2, 64, 1.0, True, torch.float32, 1.0, 0.0, False)
    temps = torch.ones(4, device=DEVICE)
    if bad == "nan":
        x[2, 2, 5] = float("nan")
    elif bad == "posinf":
        q[2, 1, 9] = float("inf")
    elif bad == "neg_temp":
        temps[2] = -1.0
    else:
        drafts[2, 0] = 64
    if not (DEVICE.type == "cuda" and bad == "token"):   # a CUDA gather OOB kills the context
        with pytest.raises((FloatingPointError, ValueError, RuntimeError, IndexError)):
            reference.verify(x, drafts, q, SamplingParams(1.0), 3, temperature=temps)
    if DEVICE.type == "cpu":                             # no host sync on CUDA: rows poisoned
        with pytest.raises(FloatingPointError):
            tb.verify(x, drafts, q, SamplingParams(1.0), 3, temperature=temps)
    out, n = tb.launch(x, drafts, q, SamplingParams(1.0), 3, temperature=temps)
    assert int(n[2]) == -1 and (out[2] == -1).all()
    clean = make_case(torch.Generator().manual_seed(2), 4, 2, 64, 1.0, True, torch.float32, 1.0,
                      0.0, False)                        # the same inputs before the damage
    ref_out, ref_n = reference.verify(*clean, SamplingParams(1.0), 3)
    keep = [0, 1, 3]                                     # other rows: unaffected
    assert torch.equal(out[keep], ref_out[keep]) and torch.equal(n[keep], ref_n[keep])


def test_top_p_falls_back_with_logged_reason(caplog):
    gen = torch.Generator().manual_seed(4)
    x, drafts, q = make_case(gen, 3, 2, 40, 1.0, True, torch.float32, 1.0, 0.0, False)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    triton_host.LOGGED.discard("top-p is not fused")
    with caplog.at_level(logging.WARNING, logger="flashspec.verify.triton"):
        a = get_backend("triton")(x, drafts, q, params, 1)
        get_backend("triton")(x, drafts, q, params, 1)
    assert sum("top-p" in r.message for r in caplog.records) == 1
    b = reference.verify(x, drafts, q, params, 1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_shape_errors_are_clear():
    x = torch.randn(2, 3, 10, device=DEVICE)
    with pytest.raises(ValueError, match="γ\\+1"):
        tb.verify(x, torch.zeros(2, 3, dtype=torch.long), None, SamplingParams(1.0), 0)
    with pytest.raises(ValueError, match="draft_logits"):
        tb.verify(x, torch.zeros(2, 2, dtype=torch.long), torch.randn(2, 2, 9),
                  SamplingParams(1.0), 0)


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_float_max_and_neg_inf_chunks(temp):
    """Chunks that hold only -inf, and maxima equal to -FLT_MAX."""
    fmax = torch.finfo(torch.float32).max
    x = torch.full((2, 3, 3000), float("-inf"))
    x[0, :, 2100] = -fmax
    x[0, :, 2500] = -fmax
    x[0, 1, 7] = -fmax
    x[1, :, 5] = 3.0
    x[1, :, 2999] = 3.0
    x[1, 2, 1500] = -fmax
    drafts = torch.tensor([[2100, 2100], [5, 2999]], device=DEVICE)
    x = x.to(DEVICE)
    plan = tb.Plan(rows=1, chunk=1024, rchunk=1024, warps=4, rwarps=4)
    params = SamplingParams(temperature=temp)
    assert_same(x, drafts, None, params, 4)
    ref = reference.verify(x, drafts, None, params, 4)
    got = tb.launch(x, drafts, None, params, 4, geometry=plan)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_argmax_ties(dtype):
    """First argmax of pass 1 (chunks of 1024, the last one partial): ties among neighbours and
    far apart inside a chunk, and across chunks; greedy fixes and races."""
    gen = torch.Generator().manual_seed(41)
    x = torch.randn(6, 2, 3000, generator=gen)
    c = 1024                                            # the second chunk
    ties = [[c + 9, c + 521, c + 513], [c + 15, c + 520], [c + 528, c + 100],
            [c + 40, c + 512], [c + 523, c + 526, 2048 + 900], [2048 + 601, 2048 + 600, 2048 + 515]]
    for b, idx in enumerate(ties):
        x[b, :, idx] = 6.0
    x[4, :, c + 8] = 5.0                                # a near-max before the ties
    drafts = torch.zeros(6, 1, dtype=torch.long)
    x = x.to(dtype).to(DEVICE)
    drafts = drafts.to(DEVICE)
    plan = tb.Plan(rows=1, chunk=1024, rchunk=1024, warps=4, rwarps=4)
    for params in (SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.7, top_k=3)):
        ref = reference.verify(x, drafts, x[:, :1].flip(-1), params, 6)
        got = tb.launch(x, drafts, x[:, :1].flip(-1), params, 6, geometry=plan)
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    out, n = tb.launch(x, drafts, None, SamplingParams(0.0), 0, geometry=plan)
    assert out[:, 0].tolist() == [min(i) for i in ties] and n.tolist() == [0] * 6


@pytest.mark.parametrize("full_q", [True, False])
def test_race_several_blocks_per_program(full_q):
    """Pass 2 with four race blocks per program (the second program's first block partial,
    the rest past V) agrees with the reference."""
    gen = torch.Generator().manual_seed(21)
    plan = tb.Plan(rows=1, chunk=2048, rchunk=4096, warps=4, rwarps=4)
    for temp in (1.0, 0.5):
        x, drafts, q = make_case(gen, 10, 3, 5000, temp, full_q, torch.bfloat16, 3.0, 0.05,
                                 False)
        for seed in (0, 1):
            params = SamplingParams(temperature=temp)
            ref = reference.verify(x, drafts, q, params, seed)
            got = tb.launch(x, drafts, q, params, seed, geometry=plan)
            assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


def test_rchunk_must_hold_whole_race_blocks():
    x, drafts, q = make_case(torch.Generator().manual_seed(0), 1, 1, 3000, 1.0, True,
                             torch.float32, 1.0, 0.0, False)
    plan = tb.Plan(rows=1, chunk=1024, rchunk=1536, warps=4, rwarps=4)
    with pytest.raises(ValueError, match="power-of-two multiple"):
        tb.launch(x, drafts, q, SamplingParams(1.0), 0, geometry=plan)


# ------------------------------------------------------------------ the two-level race
RACE_PLAN = tb.Plan(rows=1, chunk=1024, rchunk=1024, warps=4, rwarps=4)


def _rejected_at_zero(vocab: int, batch: int = 2, gamma: int = 1, x_tok: int = 1):
    """Logits whose first draft (token x_tok, one-hot q) has p = 0: rejected for sure, so the
    race runs over the residual, which is p without x_tok."""
    x = torch.full((batch, gamma + 1, vocab), float("-inf"))
    drafts = torch.full((batch, gamma), x_tok, dtype=torch.long)
    return x, drafts


def _same_both_merges(x, drafts, q, params, seed):
    """Reference == kernels, with the race's finish fused and as its own launch."""
    x, drafts = x.to(DEVICE), drafts.to(DEVICE)
    q = None if q is None else q.to(DEVICE)
    for fuse_finish in (True, False):
        options = KernelOptions(fuse_finish=fuse_finish)
        ref = reference.verify(x, drafts, q, params, seed)
        for fused in (True, False):
            got = tb.launch(x, drafts, q, params, seed, geometry=RACE_PLAN, fused=fused,
                            options=options)
            assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]), (
                ref, got, fuse_finish, fused)
    return ref


@pytest.mark.parametrize("full_q", [False, True])
def test_race_dominant_token(full_q):
    """A token holding nearly all the residual mass: its block wins the block race and the
    token the race inside it."""
    vocab = 3000
    gen = torch.Generator().manual_seed(31)
    x, drafts = _rejected_at_zero(vocab, batch=3)
    x[:] = torch.randn(3, 2, vocab, generator=gen)
    x[:, 0, 1] = float("-inf")                           # the draft token: p = 0
    x[:, :, 2222] = 40.0
    q = None
    if full_q:
        q = x[:, :1].clone()
        q[:, 0, 1] = 5.0
        q[:, 0, 2222] = 30.0                             # p > q at the winner
    for seed in range(2):
        for temp in (1.0, 0.5):
            ref = _same_both_merges(x, drafts, q, SamplingParams(temperature=temp), seed)
            assert (ref[0][:, 0] == 2222).all()


def _u_collision(vocab: int) -> tuple[int, int, int]:
    """(seed, v1, v2): v1 < v2 in the same race block with equal uniforms at row 0, position 0."""
    idx = torch.arange(vocab)
    for seed in range(400):
        u = rng.uniform(seed, torch.tensor(0), idx)
        order = torch.argsort(u, stable=True)
        su = u[order]
        for k in torch.nonzero(su[1:] == su[:-1]).flatten().tolist():
            v1, v2 = sorted((int(order[k]), int(order[k + 1])))
            if v1 // reference.RACE_BLOCK == v2 // reference.RACE_BLOCK:
                return seed, v1, v2
    raise AssertionError("no collision found")


@pytest.mark.parametrize("temp", [1.0, 0.5])
def test_race_exact_tie_takes_first_index(temp):
    """Two tokens with equal p and equal uniforms in one block (an exact key tie in the race
    inside the block): the first index wins, in the reference and in both kernel merges."""
    vocab = 6000
    seed, v1, v2 = _u_collision(vocab)
    x, drafts = _rejected_at_zero(vocab, batch=2)
    x[:, :, [v1, v2]] = 0.0
    x[:, 1, 5] = 1.0
    ref = _same_both_merges(x, drafts, None, SamplingParams(temperature=temp), seed)
    assert int(ref[0][0, 0]) == v1


def test_race_empty_residual_many_blocks():
    """q >= p wherever p > 0 (up to rounding), several blocks, one holding only -inf: the
    residual is empty and the race falls back to p."""
    vocab = 3000
    x = torch.full((1, 2, vocab), float("-inf"))
    x[0, :, 10] = 0.0
    x[0, 0, 2500] = -200.0
    q = x[:, :1].clone()
    q[0, 0, 2500] = -199.0
    drafts = torch.tensor([[2500]])
    seen = set()
    for seed in range(12):
        ref = _same_both_merges(x, drafts, q, SamplingParams(temperature=1.0), seed)
        seen.add((int(ref[1][0]), int(ref[0][0, 0])))
    assert (0, 10) in seen                               # rejected, residual empty -> token 10


def _race_masses(batch: int, gamma: int, vocab: int, plan: tb.Plan) -> torch.Tensor:
    """The race's block masses [2, B, NB] (residual W, then P) of the cached workspace of a
    launch with ``plan`` (see triton_kernels._layout)."""
    slot = next(s for k, s in tb._SLOTS.items() if k[1:4] == (batch, gamma, vocab)
                and s.plan == plan)
    nb = -(-vocab // reference.RACE_BLOCK)
    r, rq = batch * (gamma + 1), batch * gamma
    race = 3 * r * slot.nc + 2 * rq * slot.nc + int(K.N_ROWSTAT.value) * batch + r + rq
    return slot.ws[race:race + 2 * batch * nb].view(2, batch, nb).cpu()


def test_race_block_masses_match_reference():
    """The first level of the race: the kernel's block masses at j* are the reference's
    residual (or, for bonus rows, p) summed over each block, to float rounding."""
    batch, gamma, vocab = 6, 2, 5000
    gen = torch.Generator().manual_seed(5)
    x, drafts, q = make_case(gen, batch, gamma, vocab, 1.0, True, torch.float32, 3.0, 0.0,
                             False)
    params = SamplingParams(temperature=1.0)
    ref = reference.verify(x, drafts, q, params, 3)
    got = tb.launch(x, drafts, q, params, 3, geometry=RACE_PLAN, fused=False)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    W, P = _race_masses(batch, gamma, vocab, RACE_PLAN)
    temps = torch.ones(batch, device=DEVICE)
    logp = reference.warp_rows(x, params, temps)
    logq = reference.draft_logprobs(drafts, q, params, temps, vocab)
    nb = W.shape[1]
    pad = (0, nb * reference.RACE_BLOCK - vocab)
    for b in range(batch):
        j = int(ref[1][b])
        p = logp[b, j].exp()
        w = p if j == gamma else reference.race_weights(logp[b, j], logq[b, j])
        for got_m, want in ((W[b], w), (P[b], p)):
            want_m = torch.nn.functional.pad(want, pad).view(nb, -1).sum(-1)
            torch.testing.assert_close(got_m, want_m.cpu(), rtol=1e-5, atol=1e-12)
    assert (ref[1] < gamma).any() and (ref[1] == gamma).any()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="direct launch needs compiled kernels (CUDA, "
                    "TRITON_INTERPRET=0)")
@pytest.mark.parametrize("fused", [True, False])
def test_direct_launch_matches_reference(fused):
    """runtime.kernels.direct_launch=true (cached compiled kernels launched without Triton's
    binder) gives the reference's tokens and counts, with int and device seeds, every call after
    the first going through the cached handles."""
    options = KernelOptions(direct_launch=True)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0)
    for batch, vocab in ((1, 32000), (8, 49152)):
        x, drafts, q = make_case(gen, batch, 4, vocab, 1.0, True, torch.bfloat16, 3.0, 0.0, False)
        for seed in (0, 1, torch.tensor(5, device=DEVICE), 7):
            got = tb.launch(x, drafts, q, params, seed, fused=fused, options=options)
            want = reference.verify(x, drafts, q, params, seed)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (batch, seed)
