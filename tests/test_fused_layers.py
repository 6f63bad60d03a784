"""Fused decode layers (flashspec.models.fused) vs the reference layers, under the Triton
interpreter on tiny shapes: each kernel, the whole model over mixed fused/reference steps, and
greedy decoding through the engine (AR, n-gram, EAGLE drafting; eager and static-step paths)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashspec.core import Arm
from flashspec.drafters import ModelDrafter, NgramDrafter
from flashspec.drafters.eagle import EagleDrafter
from flashspec.drafters.eagle_module import EagleConfig, EagleModule
from flashspec.engine import SpecEngine
from flashspec.models import fused
from flashspec.models.llama import KVCache, LlamaLM, LlamaShape, RMSNorm, apply_rope

H, HKV, D = 6, 2, 16            # GQA: 3 query heads per kv head
CAP = 64
TOL = dict(rtol=1e-5, atol=1e-5)
# Attention geometries (query heads, kv heads, head dim, rope θ): the tiny default, and
# Qwen2.5-Coder-1.5B's (G = 6 query heads per kv head, D = 128) and -0.5B's (G = 7, D = 64),
# whose models have hidden size H * D (1536, 896) and q/k/v biases.
GEOMETRIES = {"tiny": (H, HKV, D, 10000.0), "qwen2-1.5b": (12, 2, 128, 1e6),
              "qwen2-0.5b": (14, 2, 64, 1e6)}


def tiny_shape(layers: int = 2, bias: bool = False, geometry: str = "tiny") -> LlamaShape:
    heads, kv_heads, head_dim, _ = GEOMETRIES[geometry]
    return LlamaShape(vocab_size=96, hidden_size=48 if geometry == "tiny" else heads * head_dim,
                      intermediate_size=40, num_layers=layers, num_heads=heads,
                      num_kv_heads=kv_heads, head_dim=head_dim, attention_bias=bias,
                      rms_eps=1e-5 if geometry == "tiny" else 1e-6, max_positions=128)


def inv_freq(theta: float = 10000.0, head_dim: int = D) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)


def tiny_model(layers: int = 2, bias: bool = False, seed: int = 0, geometry: str = "tiny"
               ) -> LlamaLM:
    torch.manual_seed(seed)
    _, _, head_dim, theta = GEOMETRIES[geometry]
    model = LlamaLM(tiny_shape(layers, bias, geometry), inv_freq(theta, head_dim), rope_scale=1.1)
    for name, p in model.named_parameters():
        if "norm" in name:
            torch.nn.init.normal_(p, mean=1.0, std=0.2)
        elif "embed" in name:
            torch.nn.init.normal_(p, std=1.0)
        else:   # wider inputs (the qwen2 geometries) get smaller weights: activations stay O(1)
            torch.nn.init.normal_(p, std=0.15 * min(1.0, math.sqrt(48 / p.shape[-1])))
    return model.eval().requires_grad_(False)


def ragged_positions(n: int) -> torch.Tensor:
    """Row 0 starts at 5, row 1 ends at the last cache slot (CAP - 1)."""
    return torch.stack([5 + torch.arange(n), CAP - n + torch.arange(n)])


# ----------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rmsnorm_matches_reference(with_delta):
    torch.manual_seed(0)
    x, delta, w = torch.randn(2, 3, 48), torch.randn(2, 3, 48), 1 + 0.3 * torch.randn(48)
    norm = RMSNorm(48, 1e-5)
    norm.weight.data.copy_(w)
    x0, d0 = x.clone(), delta.clone()
    res, out = fused.add_rmsnorm(x, delta if with_delta else None, w, 1e-5)
    want = x0 + d0 if with_delta else x0
    torch.testing.assert_close(res, want, **TOL)
    torch.testing.assert_close(out, norm(want), **TOL)
    assert torch.equal(x, x0), "the input residual must not be modified"


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("n", [1, 3, 5])
def test_rope_cache_write_matches_reference(n, geometry):
    torch.manual_seed(n)
    H, HKV, D, theta = GEOMETRIES[geometry]
    pos = ragged_positions(n)
    qkv = torch.randn(2, n, (H + 2 * HKV) * D)
    shape = tiny_shape(geometry=geometry)
    ref, got = (KVCache([0], 2, CAP, shape, torch.float32, "cpu") for _ in range(2))
    for c in (ref, got):
        c.k.copy_(torch.arange(c.k.numel()).view_as(c.k) * 1e-3)
        c.v.copy_(-c.k)
    q = fused.rope_cache_write(qkv, pos, got.k[0], got.v[0], inv_freq(theta, D), 1.1, H, HKV)
    freqs = pos[..., None].float() * inv_freq(theta, D)
    emb = torch.cat((freqs, freqs), -1)[:, None]
    cos, sin = emb.cos() * 1.1, emb.sin() * 1.1
    qr, kr, vr = qkv.split([H * D, HKV * D, HKV * D], -1)
    q_ref = apply_rope(qr.view(2, n, H, D).transpose(1, 2), cos, sin).transpose(1, 2)
    k_ref = apply_rope(kr.view(2, n, HKV, D).transpose(1, 2), cos, sin)
    ref.write(0, k_ref, vr.view(2, n, HKV, D).transpose(1, 2), pos, CAP)
    torch.testing.assert_close(q, q_ref, **TOL)
    torch.testing.assert_close(got.k, ref.k, **TOL)
    torch.testing.assert_close(got.v, ref.v, rtol=0, atol=0)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor
                        ) -> torch.Tensor:
    """SDPA over the whole cache with a bool mask (slot <= position), GQA by repeat."""
    g = q.shape[2] // k.shape[1]
    mask = (torch.arange(k.shape[2])[None, None, :] <= pos[:, :, None])[:, None]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(g, 1),
                                         v.repeat_interleave(g, 1), attn_mask=mask)
    return out.transpose(1, 2)


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("n,block_m", [(1, None), (3, None), (5, None), (5, 16)])
def test_decode_attention_matches_reference(n, block_m, geometry):
    torch.manual_seed(10 + n)
    H, HKV, D, _ = GEOMETRIES[geometry]
    pos = ragged_positions(n)
    k, v = torch.randn(2, HKV, CAP, D), torch.randn(2, HKV, CAP, D)
    for b in range(2):     # slots beyond a row's last position hold garbage nobody may see
        k[b, :, int(pos[b, -1]) + 1:] = 50.0
        v[b, :, int(pos[b, -1]) + 1:] = 1e4
    q = torch.randn(2, n, H, D)
    got = fused.decode_attention(q, k, v, pos, block_m=block_m)
    torch.testing.assert_close(got, attention_reference(q, k, v, pos), **TOL)


def test_decode_attention_per_query_causality():
    """Each query sees exactly slots <= its own position (not the row's last one)."""
    q, k, v = torch.randn(1, 3, H, D), torch.randn(1, HKV, CAP, D), torch.randn(1, HKV, CAP, D)
    pos = torch.tensor([[7, 8, 9]])
    got = fused.decode_attention(q, k, v, pos)
    torch.testing.assert_close(got, attention_reference(q, k, v, pos), **TOL)
    v2 = v.clone()
    v2[:, :, 9] += 100.0                   # only the last query may see slot 9
    got2 = fused.decode_attention(q, k, v2, pos)
    torch.testing.assert_close(got2[:, :2], got[:, :2], rtol=0, atol=0)
    assert (got2[:, 2] - got[:, 2]).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["identity", "cols", "parents"])
@pytest.mark.parametrize("norms", [False, True])
def test_drafter_input_matches_reference(dtype, mode, norms):
    """One launch gives what the gathers, the embedding, the two add+RMSNorm kernels and the
    concatenation give, bit for bit (bf16 too); with a tree, the nodes' positions and slots."""
    g = torch.Generator().manual_seed(3)
    b, p, n, d, v = 2, 5, 4, 48, 96
    src = torch.randn(b, p, d, generator=g).to(dtype)
    embed = torch.randn(v, d, generator=g).to(dtype)
    tokens = torch.randint(0, v, (b, n), generator=g)
    w = (1 + 0.2 * torch.randn(2, d, generator=g)).to(dtype)
    pair = (w[0], w[1], 1e-5) if norms else None
    kw, cols = {}, torch.arange(n).expand(b, n)
    if mode == "cols":
        cols = torch.randint(0, p, (b, n), generator=g)
        kw["cols"] = cols
    elif mode == "parents":
        fed = torch.stack([torch.randperm(50, generator=g)[:p] for _ in range(b)])
        pick = torch.randint(0, p, (b, n), generator=g)
        kw["parents"] = (fed, fed.gather(1, pick))
        cols = pick
    if mode != "identity":
        src = torch.cat([src, src], 1)[:, ::2]           # strided rows
        src = src[:, :p]
    else:
        src = src[:, :n]
    feats = src.gather(1, cols[..., None].expand(-1, -1, d))
    emb = F.embedding(tokens, embed)
    if norms:
        feats = fused.add_rmsnorm(feats, None, w[0], 1e-5)[1]
        emb = fused.add_rmsnorm(emb, None, w[1], 1e-5)[1]
    want = torch.cat([feats, emb], -1)
    got = fused.drafter_input(src, tokens, embed, pair, **kw)
    assert torch.equal(got, want)
    if mode == "parents":
        base, ids = torch.tensor([7, 30]), torch.randint(1, 40, (b, n), generator=g)
        got, pos, slots = fused.drafter_input(src, tokens, embed, pair, tree=(base, 3, ids), **kw)
        assert torch.equal(got, want)
        assert torch.equal(pos, (base + 3)[:, None].expand(b, n))
        assert torch.equal(slots, base[:, None] + ids)


def test_silu_mul_matches_reference():
    torch.manual_seed(3)
    gu = 3 * torch.randn(2, 5, 2 * 40)
    g, u = gu.chunk(2, -1)
    torch.testing.assert_close(fused.silu_mul(gu), F.silu(g) * u, **TOL)


# ----------------------------------------------------------------------------- weights
def test_fuse_merges_weights_as_views_and_keeps_state_dict():
    model = tiny_model(bias=True)
    keys = set(model.state_dict())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fused.fuse_model(model)
    assert model.fused and set(model.state_dict()) == keys
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    attn = model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    assert attn.v_proj.bias.data_ptr() == attn.qkv_bias[(H + HKV) * D:].data_ptr()
    assert model.layers[1].mlp.up_proj.weight.data_ptr() == \
        model.layers[1].mlp.gate_up_weight[40:].data_ptr()
    model.load_state_dict(before)         # loading copies through the views
    assert fused._aliased(attn.qkv_weight, (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight))


# ----------------------------------------------------------------------------- model
def run_steps(model: LlamaLM, use_fused: bool, layers: list[int] | None = None
              ) -> tuple[list[torch.Tensor], KVCache]:
    """A prefill of 20 tokens, then ragged steps of 1, 3, 5 tokens,
    the last one ending at the cache's last slot."""
    model.decode_layers = fused.LAYERS if use_fused else None
    g = torch.Generator().manual_seed(5)
    cache = model.new_cache(2, CAP, layers)
    steps = [torch.arange(20).expand(2, 20), torch.tensor([[20], [13]]),
             torch.tensor([[21, 22, 23], [14, 15, 16]]), ragged_positions(5)]
    outs = []
    for pos in steps:
        toks = torch.randint(0, 96, pos.shape, generator=g)
        with torch.inference_mode():
            if layers is None:
                outs.append(model(toks, pos, cache))
            else:
                outs.append(model.run_layers(model.embed_tokens(toks), pos, cache, layers))
    model.decode_layers = None
    return outs, cache


@pytest.mark.parametrize("bias,geometry", [(False, "tiny"), (True, "tiny"), (True, "qwen2-1.5b"),
                                           (True, "qwen2-0.5b")])
def test_fused_model_matches_reference(bias, geometry):
    model = fused.fuse_model(tiny_model(bias=bias, geometry=geometry))
    ref, ref_cache = run_steps(model, False)
    got, got_cache = run_steps(model, True)
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_cache.k, ref_cache.k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_cache.v, ref_cache.v, rtol=1e-4, atol=1e-4)


def test_replaced_weights_are_not_served_stale():
    """A projection swapped after fuse() (no longer a view) is read directly, not merged."""
    model = fused.fuse_model(tiny_model())
    attn = model.layers[1].self_attn
    attn.k_proj.weight = torch.nn.Parameter(2 * attn.k_proj.weight, requires_grad=False)
    model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(-model.layers[0].mlp.up_proj.weight,
                                                             requires_grad=False)
    ref, _ = run_steps(model, False)
    got, _ = run_steps(model, True)
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)


def test_fused_layer_subset_with_own_cache():
    """Layer-skip drafting: a subset of layers with a cache holding only those layers."""
    model = fused.fuse_model(tiny_model(layers=3))
    ref, _ = run_steps(model, False, layers=[0, 2])
    got, _ = run_steps(model, True, layers=[0, 2])
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)


def test_reference_path_when_not_usable():
    model = fused.fuse_model(tiny_model())
    n = fused.MAX_TOKENS + 1
    x, pos = torch.zeros(1, n, 48), torch.arange(n)[None]
    assert not fused.usable(x, pos, model.new_cache(1, CAP))        # too many tokens
    assert not fused.usable(x[:, :4], pos[:, :4], None)              # no cache
    assert fused.usable(x[:, :4], pos[:, :4], model.new_cache(1, CAP))


# ----------------------------------------------------------------------------- engine
def prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    base = torch.randint(0, 96, (10,), generator=g).tolist()
    return [(base * 4)[i:i + n] for i, n in enumerate(lengths)]


def generate(model: LlamaLM, use_fused: bool, arm: Arm, graphs: bool, lengths,
             drafter=None) -> list:
    model.decode_layers = fused.LAYERS if use_fused else None
    engine = SpecEngine(model, [arm], graphs=graphs, drafters=[drafter] if drafter else [])
    rows = engine.generate(prompts(lengths), 10).rows
    model.decode_layers = None
    return [(r.tokens, r.accept_hist) for r in rows]


@pytest.mark.parametrize("kind,graphs,lengths", [("ar", False, (12, 7)), ("ngram", False, (25, 18)),
                                                 ("ngram", True, (12, 7)), ("skip", False, (20, 17))])
def test_engine_greedy_fused_equals_reference(kind, graphs, lengths):
    model = fused.fuse_model(tiny_model())
    drafter = {"ar": None, "ngram": NgramDrafter(), "skip": ModelDrafter(model, [0], name="skip")}[kind]
    arm = Arm() if drafter is None else Arm(drafter.name, 3)
    ref = generate(model, False, arm, graphs, lengths, drafter)
    got = generate(model, True, arm, graphs, lengths, drafter)
    assert got == ref
    assert any(len(t) == 10 for t, _ in got)


@pytest.mark.parametrize("norms", [False, True])
def test_eagle_drafter_fused_equals_reference(norms):
    """``norms``: the input and output RMSNorms (EAGLE-3 style, as the trained drafter has),
    which the fused path runs as single add+RMSNorm kernels."""
    model = fused.fuse_model(tiny_model())
    module = EagleModule(model.shape, EagleConfig(in_norm=norms, out_norm=norms))
    module.init_weights(std=0.15, generator=torch.Generator().manual_seed(4))
    drafter = EagleDrafter(model, module.eval().requires_grad_(False).fuse())
    ref = generate(model, False, Arm(drafter.name, 2), False, (20, 18), drafter)
    got = generate(model, True, Arm(drafter.name, 2), False, (20, 18), drafter)
    assert got == ref


@pytest.mark.parametrize("shape", ["2x2x1", "dyn6d3k3"])
def test_eagle_tree_fused_equals_reference(shape):
    """A tree arm end to end (EAGLE expands each frontier in its own slots, the target scores
    every node in one step, paths compacted) through the fused layers: the same greedy tokens
    and acceptance as the reference layers. dyn6d3k3 drafts 21 candidates."""
    from flashspec.core import TreeShape
    model = fused.fuse_model(tiny_model())
    module = EagleModule(model.shape, EagleConfig(in_norm=True, out_norm=True))
    module.init_weights(std=0.15, generator=torch.Generator().manual_seed(4))
    drafter = EagleDrafter(model, module.eval().requires_grad_(False).fuse())
    arm = Arm(drafter.name, tree=TreeShape.parse(shape))
    ref = generate(model, False, arm, False, (20, 18), drafter)
    real, checked = module.fused_step, []

    def fused_and_reference(inputs, pos, cache, rotary, tree=None):
        """Each fused tree expansion is also run through the reference blocks under the mask."""
        out = real(inputs, pos, cache, rotary, tree=tree)
        if tree is not None:
            want = module.reference_step(inputs, model.rope(pos), tree.slots, tree.mask, cache,
                                         tree.span)
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
            checked.append(pos.shape)
        return out
    module.fused_step = fused_and_reference
    got = generate(model, True, arm, False, (20, 18), drafter)
    assert got == ref
    assert checked, "the fused layers never expanded a tree"


def test_head_dim_scale_is_inverse_sqrt():
    """Guards the softmax scale independently of SDPA's default."""
    q, k, v = torch.randn(1, 1, H, D), torch.randn(1, HKV, CAP, D), torch.randn(1, HKV, CAP, D)
    pos = torch.tensor([[3]])
    got = fused.decode_attention(q, k, v, pos)
    s = torch.einsum("hd,hsd->hs", q[0, 0], k[0].repeat_interleave(3, 0)[:, :4]) / math.sqrt(D)
    want = torch.einsum("hs,hsd->hd", s.softmax(-1), v[0].repeat_interleave(3, 0)[:, :4])
    torch.testing.assert_close(got[0, 0], want, **TOL)


@pytest.mark.parametrize("lengths,nodes,geometry", [((9, 9), 9, "tiny"), ((7, 12), 9, "tiny"),
                                                    ((40, 90), 9, "tiny"), ((9, 12), 70, "tiny"),
                                                    ((7, 12), 9, "qwen2-1.5b"),
                                                    ((40, 90), 9, "qwen2-0.5b")])
def test_fused_tree_step_matches_reference(lengths, nodes, geometry):
    """A draft-tree step (RoPE by depth, own slots, ancestor bitmask attention) through the
    fused layers equals the reference layers under the tree mask: hidden states and the cache,
    ragged rows, a tree of 9 nodes with different shapes per row. (40, 90): prefixes over
    several plain key blocks (32 slots in fp32), a tree that straddles a block boundary. 70
    nodes: random trees whose ancestor masks take two 64-bit words. The qwen2 geometries:
    query groups of 6 and 7 heads, head dims 128 and 64, biases."""
    from flashspec.core import TreeDraft
    from flashspec.tree import tree_attention
    model = fused.fuse_model(tiny_model(bias=geometry != "tiny", geometry=geometry))
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 3, 6], [-1, 0, 1, 2, 3, 0, 5, 0, 7]])
    if nodes != 9:
        g = torch.Generator().manual_seed(nodes)
        parents = torch.tensor([[-1] + [int(torch.randint(max(0, i - 4), i, (), generator=g))
                                        for i in range(1, nodes)] for _ in range(2)])
    depth = torch.zeros_like(parents)
    for i in range(1, parents.shape[1]):
        depth[:, i] = depth.gather(1, parents[:, i:i + 1])[:, 0] + 1
    gen = torch.Generator().manual_seed(4)
    tree = TreeDraft(torch.randint(0, 96, parents.shape, generator=gen), parents, depth)
    lens = torch.tensor(lengths)
    span = int(lens.max()) + tree.size
    outs, caches = [], []
    for use_fused in (False, True):
        model.decode_layers = fused.LAYERS if use_fused else None
        cache = model.new_cache(2, 2 * CAP)
        prefix = torch.randint(0, 96, (2, int(lens.max()) - 1), generator=torch.Generator().manual_seed(5))
        with torch.inference_mode():
            model.decode_layers = None       # the same prefix cache for both
            model.forward_hidden(prefix, torch.arange(prefix.shape[1]).expand(2, -1), cache,
                                 span=prefix.shape[1])
            model.decode_layers = fused.LAYERS if use_fused else None
            positions, attention = tree_attention(tree, lens, span)
            outs.append(model.forward_hidden(tree.tokens, positions, cache, span=span,
                                             tree=attention))
        caches.append(cache)
    model.decode_layers = None
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    for k in ("k", "v"):
        torch.testing.assert_close(getattr(caches[1], k), getattr(caches[0], k), rtol=1e-4,
                                   atol=1e-4)


def _random_tree(nodes: int, batch: int, seed: int):
    from flashspec.core import TreeDraft
    g = torch.Generator().manual_seed(seed)
    parents = torch.tensor([[-1] + [int(torch.randint(max(0, i - 3), i, (), generator=g))
                                    for i in range(1, nodes)] for _ in range(batch)])
    depth = torch.zeros_like(parents)
    for i in range(1, nodes):
        depth[:, i] = depth.gather(1, parents[:, i:i + 1])[:, 0] + 1
    return TreeDraft(torch.zeros_like(parents), parents, depth)


@pytest.mark.parametrize("nodes,batch", [(1, 1), (9, 3), (64, 2), (65, 2), (150, 1)])
def test_tree_path_kernel_matches_reference(nodes, batch):
    """The path table the tree attention reads (one Triton launch per step) equals the torch
    reference :func:`flashspec.core.path_table` and each node's ancestors, root first: masks of
    one, two and three 64-bit words, a lone root."""
    from flashspec.core import TreeAttention, path_table
    tree = _random_tree(nodes, batch, seed=nodes)
    bits = tree.ancestor_bits()
    attention = TreeAttention(torch.zeros(batch, nodes, dtype=torch.long), bits,
                              torch.full((batch,), 4), 4 + nodes)
    got = fused.tree_path(attention)
    assert torch.equal(got, path_table(bits))
    assert fused.tree_path(attention) is got and attention.path is got    # once per step
    anc = tree.ancestors()
    for b in range(batch):
        for t in range(nodes):
            path = [j for j in range(nodes) if anc[b, t, j]]
            assert got[b, t, 0] == len(path) and got[b, t, 1:1 + len(path)].tolist() == path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lengths,nodes,heads", [
    ((5, 9), 8, (H, HKV)), ((130, 250), 17, (H, HKV)), ((126, 64), 33, (H, HKV)),
    ((70, 140), 17, (4, 4)), ((140, 30), 9, (14, 2)), ((20, 129), 6, (36, 2)),
    ((130, 40), 17, (12, 1)), ((33, 300), 70, (10, 1))])
def test_tree_attention_is_the_ar_step_bit_for_bit(dtype, lengths, nodes, heads):
    """Each tree node's attention output equals, bit for bit, the AR step at the node's position
    over a cache holding the prefix and then the node's path (root .. node) in AR's slots: the
    same key blocks, lanes and reductions, whichever slots the tree put the ancestors in.
    Prefixes below, across and past a 128-slot key block (bf16) and 32-slot one (fp32). Under
    the interpreter a different block split or lane order changes the bits, so a tree kernel
    that does not walk the path in AR's order fails here. Query groups G of 3, 1, 7, 12
    and 18 (a node over two 16-row blocks); masks of one and two 64-bit words. The outputs are
    kept in fp32 (16-bit inputs, the kernel's 16-bit arithmetic): rounded to bf16, an order change would show only
    now and then, as on the GPU."""
    from flashspec.tree import tree_attention
    head_dim, cap = 64, 512
    n_heads, kv_heads = heads
    tree = _random_tree(nodes, 2, seed=nodes)
    lens = torch.tensor(lengths)
    g = torch.Generator().manual_seed(11)
    k = torch.randn(2, kv_heads, cap, head_dim, generator=g).to(dtype)
    v = torch.randn(2, kv_heads, cap, head_dim, generator=g).to(dtype)
    q = torch.randn(2, nodes, n_heads, head_dim, generator=g).to(dtype)
    positions, attention = tree_attention(tree, lens, cap)
    got = fused.decode_attention(q, k, v, positions, tree=attention,
                                 out=torch.empty(q.shape, dtype=torch.float32))
    anc = tree.ancestors()
    for b in range(2):
        base = int(lens[b]) - 1
        for t in range(nodes):
            path = [base + j for j in range(nodes) if anc[b, t, j]]       # root .. t, in AR order
            ar_k, ar_v = k[b:b + 1].clone(), v[b:b + 1].clone()
            ar_k[:, :, base:base + len(path)] = k[b:b + 1, :, path]
            ar_v[:, :, base:base + len(path)] = v[b:b + 1, :, path]
            pos = torch.tensor([[base + len(path) - 1]])
            assert int(positions[b, t]) == int(pos)
            want = fused.decode_attention(q[b:b + 1, t:t + 1].contiguous(), ar_k, ar_v, pos,
                                          out=torch.empty(1, 1, n_heads, head_dim))
            assert torch.equal(got[b, t], want[0, 0]), (b, t, path)
