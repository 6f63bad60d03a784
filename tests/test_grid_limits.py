"""Every Triton launch fits CUDA's grid limits at any batch size (issue 45).

CUDA takes 2^31 - 1 programs on grid axis 0 but only 65,535 on axes 1 and 2; a launch that put
the row group on axis 1 failed with "Triton Error [CUDA]: invalid argument" at 65,536 rows.
Launches now keep everything that grows with the batch on axis 0.

- On the CPU: the GPU plan's chain-verify launches at 65,535 / 65,536 / 200,000 rows, built on
  the meta device (no memory, no kernel run), fit the limits, and the GPU geometry (one row per
  program: many row groups and chunks on the shared axis) runs under the interpreter and
  returns the reference's tokens.
- On a CUDA machine (``TRITON_INTERPRET=0 pytest tests/test_grid_limits.py``): chain and tree
  verify, greedy and T = 1, at those row counts return the reference's tokens, and the fused
  tree compaction equals the torch one at 70,000 rows.

Inputs leave float rounding nothing to decide, so any difference is a bug rather than a near
tie: the greedy cases' logits are multiples of 1/64 (the reference's argmax of log-softmax
cannot round two distinct maxima into a tie), the T = 1 cases' are 0 on a random support and
-inf elsewhere (every probability is 1/k with k an exact count, whatever the reduction order).
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported anywhere

import pytest
import torch

from flashspec.core import SamplingParams, TreeDraft
from flashspec.kernels import MAX_GRID_Y, choose
from flashspec.tree import compact_path
from flashspec.verify import get_backend, reference, verify, verify_tree
from flashspec.verify import triton_backend as tb

CUDA_GRID = (2**31 - 1, 65535, 65535)
ROWS = [65535, 65536, 200_000]
ON_CUDA = not tb.INTERPRET and torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="needs CUDA and TRITON_INTERPRET=0")

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning")]


def test_limit_constant_is_cudas():
    assert MAX_GRID_Y == CUDA_GRID[1] == CUDA_GRID[2]


@pytest.mark.parametrize("batch", ROWS)
@pytest.mark.parametrize("fused", [True, False])
def test_gpu_plan_grids_fit_cuda_limits(batch, fused):
    """The launches of the GPU plan (one row per program) as built for a CUDA call."""
    gamma, vocab = 3, 50_000
    p = tb.plan(batch, gamma, vocab, interpret=False)
    key = ("grid-limits-test", batch, fused)
    flags = dict(HAS_Q=True, TOPK=False, ROW_TEMP=False)
    slot = tb._slot(key, p, fused, batch, gamma, vocab, 0, flags, torch.device("meta"), False)
    tb._SLOTS.pop(key, None)
    assert {name for name, *_ in slot.launches} >= {"stats", "race"}
    for name, _, grid, _, _ in slot.launches:
        assert len(grid) == 3 and all(1 <= n <= cap for n, cap in zip(grid, CUDA_GRID)), (
            f"{name} grid {grid} exceeds CUDA's {CUDA_GRID}")


def test_long_drafts_fall_back_to_the_reference():
    """γ + 1 positions sit on grid axis 1: longer drafts than it holds go to the reference."""
    x = torch.zeros(1, MAX_GRID_Y + 1, 2, device="cuda" if torch.cuda.is_available() else "cpu")
    assert "draft lengths" in choose("verify", x, draft_logits=None,
                                     params=SamplingParams(1.0)).reason
    assert choose("verify", x[:, :MAX_GRID_Y], draft_logits=None,
                  params=SamplingParams(1.0)).reason is None


@pytest.mark.parametrize("params", [SamplingParams(0.0), SamplingParams(1.0),
                                    SamplingParams(1.0, top_k=5)])
def test_gpu_geometry_many_groups_in_interpreter(params):
    """Row groups and chunks sharing grid axis 0 (several of each, and several top-k tiles),
    run under the interpreter: the reference's tokens."""
    if ON_CUDA:
        pytest.skip("interpreter check")
    gen = torch.Generator().manual_seed(45)
    batch, gamma, vocab = 5, 2, 2500
    x = torch.randn(batch, gamma + 1, vocab, generator=gen) * 3
    q = x[:, :gamma] + torch.randn(batch, gamma, vocab, generator=gen)
    drafts = torch.randint(0, vocab, (batch, gamma), generator=gen)
    drafts[:, 0] = x[:, 0].argmax(-1)                 # some rows accept
    geometry = tb.Plan(rows=1, chunk=1024, rchunk=1024, warps=4, rwarps=4)
    for fused in (True, False):
        want = reference.verify(x, drafts, q, params, 9)
        got = tb.launch(x, drafts, q, params, 9, fused=fused, geometry=geometry)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), (fused, want, got)


# ----------------------------------------------------------------------------- CUDA only
def support_logits(shape: tuple[int, ...], gen: torch.Generator, device: str) -> torch.Tensor:
    """0 on a random support (at least one token), -inf elsewhere."""
    x = torch.where(torch.rand(shape, generator=gen, device=device) < 0.01, 0.0, float("-inf"))
    first = torch.randint(0, shape[-1], (*shape[:-1], 1), generator=gen, device=device)
    return x.scatter(-1, first, 0.0)


def greedy_logits(shape: tuple[int, ...], gen: torch.Generator, device: str) -> torch.Tensor:
    """Normal logits (scale 4) rounded to multiples of 1/64: distinct values stay distinct."""
    return (torch.randn(shape, generator=gen, device=device) * 256).round() / 64


def chain_case(batch: int, temp: float, gen: torch.Generator, dev: str = "cuda", gamma: int = 2,
               vocab: int = 1000):
    """(target logits, drafts, draft logits or None): greedy drafts near the target argmax;
    T = 1 drafts drawn from support-logit q."""
    if temp == 0:
        x = greedy_logits((batch, gamma + 1, vocab), gen, dev)
        drafts = x[:, :gamma].argmax(-1)
        noise = torch.rand(batch, gamma, generator=gen, device=dev) < 0.3
        drafts = torch.where(noise, torch.randint(0, vocab, drafts.shape, generator=gen,
                                                  device=dev), drafts)
        return x, drafts, None
    x = support_logits((batch, gamma + 1, vocab), gen, dev)
    q = torch.maximum(x[:, :gamma], support_logits((batch, gamma, vocab), gen, dev))
    drafts = torch.multinomial(torch.softmax(q, -1).reshape(-1, vocab), 1,
                               generator=gen).view(batch, gamma)
    return x, drafts, q


def tree_case(batch: int, temp: float, gen: torch.Generator, dev: str = "cuda",
              vocab: int = 1000):
    """(target logits [B, 6, V], one-hot TreeDraft) of the tree 0 -> (1, 2), 1 -> (3, 4),
    3 -> 5: children are the top tokens of (target logits + noise) at their parent."""
    parents = torch.tensor([-1, 0, 0, 1, 1, 3], device=dev)
    depth = torch.tensor([0, 1, 1, 2, 2, 3], device=dev)
    width = parents.numel()
    x = (greedy_logits((batch, width, vocab), gen, dev) if temp == 0 else
         support_logits((batch, width, vocab), gen, dev))
    keys = torch.nan_to_num(x, neginf=-1e4) + torch.rand(x.shape, generator=gen, device=dev)
    tokens = torch.zeros(batch, width, dtype=torch.long, device=dev)
    for node in range(width):
        kids = (parents == node).nonzero().flatten()
        if kids.numel():
            tokens[:, kids] = keys[:, node].topk(kids.numel(), dim=-1).indices
    return x, TreeDraft(tokens, parents.expand(batch, -1).contiguous(),
                        depth.expand(batch, -1).contiguous(), None)


def mismatch(want: tuple[torch.Tensor, ...], got: tuple[torch.Tensor, ...]) -> str | None:
    """None when every output is equal, else which rows differ."""
    rows = torch.zeros(want[0].shape[0], dtype=torch.bool, device=want[0].device)
    for w, g in zip(want, got):
        rows |= (w != g).reshape(w.shape[0], -1).any(1)
    bad = rows.nonzero().flatten()
    if bad.numel() == 0:
        return None
    r = int(bad[0])
    return (f"{bad.numel()} rows differ (first {bad[:8].tolist()}); row {r}: reference "
            f"{[t[r].tolist() for t in want]} vs triton {[t[r].tolist() for t in got]}")


@needs_cuda
@pytest.mark.parametrize("batch", ROWS)
@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_chain_verify_on_cuda_at_any_batch(batch, temp):
    gen = torch.Generator(device="cuda").manual_seed(batch + int(temp))
    x, drafts, q = chain_case(batch, temp, gen)
    params = SamplingParams(temp)
    want = get_backend("torch").verify(x, drafts, q, params, 17)
    got = verify(x, drafts, q, params, 17, backend="triton")         # the public entry
    assert mismatch(want, got) is None, mismatch(want, got)
    n = want[1]
    assert (n == 0).any() and (n > 0).any()          # accepts and rejections both occur


@needs_cuda
@pytest.mark.parametrize("batch", ROWS)
@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_tree_verify_on_cuda_at_any_batch(batch, temp):
    gen = torch.Generator(device="cuda").manual_seed(batch + 7 + int(temp))
    x, draft = tree_case(batch, temp, gen)
    params = SamplingParams(temp)
    want = get_backend("torch").verify_tree(x, draft, params, 23, depth=3)
    got = verify_tree(x, draft, params, 23, backend="triton", depth=3)
    assert mismatch(want, got) is None, mismatch(want, got)
    assert (want[1] == 0).any() and (want[1] > 0).any()


@needs_cuda
def test_tree_compaction_on_cuda_at_any_batch():
    from flashspec.models.llama import KVCache, LlamaShape
    batch = 70_000
    shape = LlamaShape(vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=2,
                       num_heads=2, num_kv_heads=1, head_dim=4)
    gen = torch.Generator(device="cuda").manual_seed(5)
    lengths = torch.randint(1, 6, (batch,), generator=gen, device="cuda")
    path = torch.tensor([[1, 3, 5], [2, -1, -1], [-1, -1, -1]], device="cuda").repeat(
        batch // 3 + 1, 1)[:batch]
    hidden = torch.randn(batch, 6, 8, generator=gen, device="cuda")
    out = []
    for fused in (False, True):
        cache = KVCache([0, 1], batch, 12, shape, torch.float32, "cuda")
        cache.k.copy_(torch.randn(cache.k.shape, generator=gen.manual_seed(1), device="cuda"))
        cache.v.copy_(torch.randn(cache.v.shape, generator=gen.manual_seed(2), device="cuda"))
        out.append((compact_path(cache, hidden, path, lengths, fused=fused), cache.k, cache.v))
    for want, got in zip(*out):
        assert torch.equal(want, got)
