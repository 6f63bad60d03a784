"""Draft trees (flashspec.tree, the tree step of flashspec.engine): shapes, drafting, the tree
mask and positions against plain forwards of each path, K/V compaction, and greedy output equal
to target-only AR in fp32 on the real SmolLM2 with the trained EAGLE drafter (the distribution
gates are in test_exactness_tree.py and test_exactness_engine.py ``eagletree``)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from omegaconf import OmegaConf

from experiments.harness import build_arms
from flashspec.core import Arm, SamplingParams, TreeDraft, TreeShape
from flashspec.drafters import DraftContext, EagleDrafter, ModelDrafter, NgramDrafter
from flashspec.drafters.ngram import branch_tree, device_branches, lookup
from flashspec.engine import SpecEngine
from flashspec.errors import FlashSpecError
from flashspec.heads import LowRankChoice
from flashspec.metrics import alpha_by_depth
from flashspec.models import load_model
from flashspec.tree import grow_tree, tree_attention
from test_engine import TEXTS, load_small_model
from exactness.tree_harness import static_tree
from test_exactness_engine import EAGLE


def test_shapes_parse_and_count() -> None:
    assert TreeShape.parse("4x2x1") == TreeShape(branching=(4, 2, 1))
    assert TreeShape.parse("4x2x1").size == 4 + 8 + 8 and TreeShape.parse("4x2x1").max_depth == 3
    dyn = TreeShape.parse("dyn15")
    assert (dyn.nodes, dyn.depth, dyn.top_k, dyn.label) == (15, 6, 4, "dyn15d6k4")
    assert dyn.candidates == 4 + 5 * 16
    for bad in ("4x0", "tree", "dyn3d5", "8x8x8"):
        with pytest.raises(FlashSpecError):
            TreeShape.parse(bad)


def fake_expand(vocab: int, seed: int = 0):
    """Drafter stand-in: pseudo-random log-probabilities per (node id, depth)."""
    def expand(ids, toks, parents, depth, anc):
        gen = torch.Generator().manual_seed(seed + depth)
        base = torch.randn(ids.shape[0], 1, vocab, generator=gen)
        return base + 0.5 * toks[..., None].float().sin() * torch.arange(vocab)
    return expand


@pytest.mark.parametrize("spec", ["3x2x1", "dyn9d4k3", "dyn5d5k1"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grown_trees_are_trees(spec: str, temperature: float) -> None:
    """Topological, depths consistent, distinct siblings; sampled trees carry each node's
    logits and keep siblings as a prefix of their draw order."""
    shape, vocab = TreeShape.parse(spec), 40
    root = torch.randn(2, vocab)
    tree = grow_tree(root, torch.tensor([7, 8]), shape, fake_expand(vocab),
                     SamplingParams(temperature), torch.Generator().manual_seed(1))
    assert (tree.logits is None) == (temperature == 0)
    if tree.logits is not None:
        assert tree.logits.shape == (2, shape.size + 1, vocab)
        torch.testing.assert_close(tree.logits[:, 0], root)
    assert tree.tokens.shape == (2, shape.size + 1) and (tree.tokens[:, 0] == torch.tensor([7, 8])).all()
    assert (tree.parents[:, 0] == -1).all() and (tree.parents[:, 1:] >= 0).all()
    assert (tree.parents[:, 1:] < torch.arange(1, shape.size + 1)).all()       # topological
    par = tree.parents.clamp(min=0)
    assert (tree.depth[:, 1:] == tree.depth.gather(1, par)[:, 1:] + 1).all()
    assert int(tree.depth.max()) <= shape.max_depth
    kids = tree.children()
    for b in range(2):      # siblings distinct tokens; children() lists each node once
        listed = sorted(int(k) for k in kids[b].flatten() if k >= 0)
        assert listed == list(range(1, shape.size + 1))
        for row in kids[b]:
            toks = [int(tree.tokens[b, k]) for k in row if k >= 0]
            assert len(toks) == len(set(toks))
    # the ancestor matrix drafting built (dynamic: restricted to the kept nodes) is the tree's
    derived = TreeDraft(tree.tokens, tree.parents, tree.depth).ancestors()
    assert tree.bits is not None and torch.equal(tree.ancestors(), derived)


def recording_expand(vocab: int, levels: int, seen: list):
    """A drafter stand-in with few distinct log-probabilities (ties between siblings and
    between frontier candidates are common) that records what each expansion was given."""
    def expand(ids, toks, parents, depth, bits):
        seen.append((ids.clone(), toks.clone(), parents.clone(), bits.clone()))
        gen = torch.Generator().manual_seed(depth)
        base = torch.randint(0, levels, (ids.shape[0], 1, vocab), generator=gen).float()
        return base + (toks[..., None] * 7 + torch.arange(vocab)) % levels
    return expand


@pytest.mark.parametrize("spec", ["3x2x1", "dyn9d4k3", "dyn5d5k1", "dyn15", "dyn20d5k5"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fused_tree_bookkeeping_equals_torch(spec: str, temperature: float) -> None:
    """The Triton bookkeeping (one kernel per depth, one for the final choice; interpreter on
    the CPU) gives the torch path's tree, bit for bit: tokens, parents, depths, ancestor bits,
    sampled logits, and what every expansion was given. Ties are common here (few distinct
    logits); candidates beyond 64 need two bitmask words (dyn15: 84, dyn20d5k5: 105)."""
    shape, vocab = TreeShape.parse(spec), 48
    root = torch.randint(0, 3, (3, vocab)).float()
    trees, seen = [], []
    for fused in (False, True):
        seen.append([])
        params = SamplingParams(temperature)
        seed = None if params.greedy else torch.tensor(11)
        trees.append(grow_tree(root, torch.tensor([5, 6, 7]), shape,
                               recording_expand(vocab, 3, seen[-1]), params, seed=seed,
                               fused=fused))
    ref, got = trees
    for name in ("tokens", "parents", "depth", "bits"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert (got.logits is None) == params.greedy
    if got.logits is not None:
        assert torch.equal(got.logits, ref.logits)
    assert len(seen[0]) == len(seen[1]) == shape.max_depth - 1
    for a, b in zip(*seen):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(ref.ancestors(), TreeDraft(ref.tokens, ref.parents, ref.depth).ancestors())


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return load_small_model(tmp_path_factory, n_layers=4)


def test_tree_forward_equals_each_paths_plain_forward(four) -> None:
    """Node i's logits in one tree forward (own slot, tree mask, RoPE by depth) equal the last
    logits of a plain cached forward of prefix + the path to i; then KVCache.move puts the
    accepted path's K/V where a chain step would have written them."""
    model, tok = four
    prefix = tok("def add(a, b):\n    return", return_tensors="pt")["input_ids"]
    L = prefix.shape[1] + 1          # committed length: the prefix plus the root token
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3]])
    depth = torch.tensor([[0, 1, 1, 2, 2, 2, 3]])
    tree = TreeDraft(torch.tensor([[11, 5, 9, 13, 17, 21, 25]]), parents, depth)
    cache = model.new_cache(1, 64)
    with torch.inference_mode():
        model.forward_hidden(prefix, torch.arange(L - 1)[None], cache, span=L - 1)
        lengths = torch.tensor([L])
        span = L + tree.size
        pos, attention = tree_attention(tree, lengths, span)
        logits = model.logits(model.forward_hidden(tree.tokens, pos, cache, span=span,
                                                   tree=attention))
        for node in range(tree.size + 1):
            path, n = [], node
            while n >= 0:
                path.insert(0, n)
                n = int(parents[0, n])
            ids = torch.cat([prefix, tree.tokens[:, path]], dim=1)
            ref = model(ids, torch.arange(ids.shape[1])[None])[0, -1]
            torch.testing.assert_close(logits[0, node], ref, atol=2e-4, rtol=2e-4)
        # accept the path 0 -> 1 -> 3 -> 6: move its K/V to slots L, L + 1, L + 2
        src = torch.tensor([[L - 1 + 1, L - 1 + 3, L - 1 + 6]])
        dst = torch.tensor([[L, L + 1, L + 2]])
        want_k = cache.k[:, 0, :, src[0]].clone()
        cache.move(src, dst)
        torch.testing.assert_close(cache.k[:, 0, :, dst[0]], want_k)
        chain = model.new_cache(1, 64)
        ids = torch.cat([prefix, tree.tokens[:, [0, 1, 3, 6]]], dim=1)
        model.forward_hidden(ids, torch.arange(ids.shape[1])[None], chain, span=ids.shape[1])
        torch.testing.assert_close(cache.k[:, 0, :, :L + 3], chain.k[:, 0, :, :L + 3], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_compaction_equals_torch(dtype) -> None:
    """compact_path in one Triton launch (interpreter here) equals the torch gathers and
    scatters: K and V of every layer and head, paths whose sources overlap later destinations
    (node 3 at slot L + 2 moves to L while depth 3 lands on L + 2), paths that stop early, and
    the hidden states of the root and the path; slots off the path are left alone."""
    from flashspec.models.llama import KVCache, LlamaShape
    from flashspec.tree import compact_path
    shape = LlamaShape(vocab_size=16, hidden_size=40, intermediate_size=8, num_layers=3,
                       num_heads=4, num_kv_heads=3, head_dim=8)
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([5, 9, 2, 7])
    path = torch.tensor([[3, 5, 8, 11], [1, 2, -1, -1], [-1, -1, -1, -1], [2, 4, 6, 9]])
    hidden = torch.randn(4, 12, 40, generator=gen).to(dtype)
    out = []
    for fused in (False, True):
        cache = KVCache([0, 1, 2], 4, 24, shape, dtype, "cpu")
        cache.k.copy_(torch.randn(cache.k.shape, generator=torch.Generator().manual_seed(1)))
        cache.v.copy_(torch.randn(cache.v.shape, generator=torch.Generator().manual_seed(2)))
        out.append((compact_path(cache, hidden, path, lengths, fused=fused), cache.k, cache.v))
    (h_ref, k_ref, v_ref), (h, k, v) = out
    assert torch.equal(h, h_ref) and torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert torch.equal(h_ref[0, 1:], hidden[0, [3, 5, 8, 11]]) and torch.equal(h_ref[2], hidden[2, [0] * 5])
    fresh = KVCache([0, 1, 2], 4, 24, shape, dtype, "cpu")
    fresh.k.copy_(torch.randn(fresh.k.shape, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(k_ref[:, 0, :, 5], fresh.k[:, 0, :, 5 - 1 + 3])       # node 3 -> slot L
    assert torch.equal(k_ref[:, 0, :, 9:], fresh.k[:, 0, :, 9:])             # past the path


def test_alpha_by_depth() -> None:
    assert alpha_by_depth([[2, 1, 1], [0, 0, 0, 4]]) == [6 / 8, 5 / 6, 4 / 5]


def test_tree_arms_from_config(four) -> None:
    model, _ = four
    eagle = EagleDrafter.build(DraftContext(model), "eagle", checkpoint=str(EAGLE))
    cfg = OmegaConf.create({"drafters": {}, "arms": [["eagle", 3], ["eagle", "4x2"], ["eagle", "dyn8"]]})
    arms = build_arms(cfg, {"eagle": eagle, "ngram": NgramDrafter()})
    assert [a.label for a in arms] == ["eagle@3", "eagle@4x2", "eagle@dyn8d6k4"]
    assert arms[1].gamma == 2 and arms[2].reach == TreeShape.parse("dyn8").candidates
    ngram = build_arms(OmegaConf.create({"arms": [["ngram", "3x1x1"]]}), {"ngram": NgramDrafter()})
    assert [(a.label, a.gamma, a.reach) for a in ngram] == [("ngram@3x1x1", 3, 9)]
    for spec in ("2x2", "dyn8"):    # an n-gram tree is one continuation per branch
        with pytest.raises(FlashSpecError, match="one continuation per branch"):
            build_arms(OmegaConf.create({"arms": [["ngram", spec]]}), {"ngram": NgramDrafter()})
    skip = ModelDrafter(model, [0], name="skip1")
    with pytest.raises(FlashSpecError, match="chains only"):
        build_arms(OmegaConf.create({"arms": [["skip1", "2x1"]]}), {"skip1": skip})


def host_branches(row: list[int], k: int, depth: int, max_n: int, min_n: int) -> list[list[int]]:
    """:func:`device_branches` on the host, plainly: every continuation after an earlier
    occurrence of a suffix n-gram, longest n first and then the latest, the first k that begin
    with different tokens."""
    ranked, seen = [], set()
    for n in range(min(max_n, len(row) - 1), min_n - 1, -1):
        for start in range(len(row) - n - 1, -1, -1):
            if row[start:start + n] == row[len(row) - n:] and start + n not in seen:
                seen.add(start + n)
                ranked.append(row[start + n:start + n + depth])
    out = []
    for cont in ranked:
        if len(out) < k and all(cont[0] != o[0] for o in out):
            out.append(cont)
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=24), min_size=1, max_size=4),
       st.integers(1, 4), st.integers(1, 5), st.integers(1, 3), st.integers(1, 3))
def test_ngram_branches_equal_the_host_form(rows, k, depth, a, b) -> None:
    """The device form of several n-gram continuations per row equals the host form; branch 0
    is the chain's lookup; missing tokens repeat the row's last token; the tree of the branches
    has the static k x 1 x ... x 1 shape's parents and depths."""
    max_n, min_n = max(a, b), min(a, b)
    tokens = torch.zeros(len(rows), 30, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rows])
    drafts, real = device_branches(tokens, lengths, k, depth, max_n, min_n)
    for i, r in enumerate(rows):
        want = host_branches(r, k, depth, max_n, min_n)
        assert real[i].tolist() == [len(w) for w in want] + [0] * (k - len(want))
        for j in range(k):
            got, w = drafts[i, j].tolist(), want[j] if j < len(want) else []
            assert got == w + [r[-1]] * (depth - len(w))
        assert (want[0] if want else []) == lookup(r, depth, max_n, min_n)
    tree = branch_tree(drafts, tokens[:, 0])
    static = TreeShape.parse("x".join([str(k)] + ["1"] * (depth - 1)))
    assert tree.size == static.size
    parents, depths = static_tree(static.branching)
    assert tree.parents[0].tolist() == parents and tree.depth[0].tolist() == depths


@pytest.fixture(scope="module")
def smol():
    model, tok = load_model("smollm2")     # fp32 on the CPU
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       return_dict=True)["input_ids"] for t in TEXTS]
    eagle = EagleDrafter.build(DraftContext(model, tok), "eagle", checkpoint=str(EAGLE),
                               head=LowRankChoice(rank=72, init="trained"))
    return model, tok, prompts, eagle


@pytest.fixture(scope="module")
def target_only(smol):
    """The target's greedy rows (target-only AR in the reference stepper), decoded once for the
    tests below instead of once or twice in each: 40 new tokens; an EOS that row 0 reaches
    mid-stream (its first new token at index 6 or later); and 37 new tokens with that EOS."""
    model, tok, prompts, _ = smol
    ar = SpecEngine(model, [Arm()]).generate(prompts, 40).rows
    eos = [next(t for i, t in enumerate(ar[0].tokens) if i >= 6 and t not in ar[0].tokens[:i])]
    ar_eos = SpecEngine(model, [Arm()], eos_ids=eos).generate(prompts, 37).rows
    return ar, eos, ar_eos


@pytest.fixture(scope="module")
def eagle_tree(smol, target_only):
    """``eagle_tree(spec)``: the trained drafter's tree arm of that shape in the reference
    stepper, greedy, with the EOS and a budget of 37. Decoded once per shape for the module:
    test_tree_greedy_equals_target_only checks it against the target, the resident and
    drafted-ahead tests use it as their reference loop."""
    model, _, prompts, eagle = smol
    _, eos, _ = target_only
    runs: dict[str, list] = {}

    def run(spec: str) -> list:
        if spec not in runs:
            runs[spec] = SpecEngine(model, [Arm("eagle", tree=TreeShape.parse(spec))], drafters=[eagle],
                                    eos_ids=eos).generate(prompts, 37).rows
        return runs[spec]
    return run


@pytest.mark.parametrize("spec", ["3x2x1", "dyn12"])
def test_tree_greedy_equals_target_only(smol, target_only, eagle_tree, spec) -> None:
    """fp32 CPU, the trained drafter, a batch of prompts with ragged acceptance, an EOS that
    row 0 reaches mid-stream, and a budget that ends inside accepted runs."""
    model, tok, prompts, eagle = smol
    ar, _, ar_eos = target_only
    without_eos = SpecEngine(model, [Arm("eagle", tree=TreeShape.parse(spec))], drafters=[eagle]
                             ).generate(prompts, 40).rows
    for out, ref in ((without_eos, ar), (eagle_tree(spec), ar_eos)):
        assert [r.tokens for r in out] == [r.tokens for r in ref]
        assert sum(r.n_accepted for r in out) > 0
        assert all(sum(r.accept_hist) == r.steps for r in out)


@pytest.mark.parametrize("spec", ["3x2x1", "dyn12"])
def test_resident_tree_equals_reference_loop(smol, target_only, eagle_tree, spec) -> None:
    """A tree arm in the captured stepper (drafting over the device token buffer, one target pass
    over the whole cache, verify_tree, K/V compaction, features to the drafter; every step
    eager here) gives the reference stepper's tokens, steps, accepted counts and histograms:
    ragged acceptance, an EOS inside accepted runs, a budget that ends inside one."""
    model, tok, prompts, eagle = smol
    _, eos, _ = target_only
    arms = [Arm("eagle", tree=TreeShape.parse(spec))]
    ref = eagle_tree(spec)
    assert sum(r.n_accepted for r in ref) > 0
    for chunk in (1, 4):
        engine = SpecEngine(model, arms, drafters=[eagle], eos_ids=eos, resident=True, chunk=chunk)
        engine.min_capacity = 256      # the eager steps attend the whole cache: keep it short
        got = engine.generate(prompts, 37).rows
        assert [(r.tokens, r.steps, r.n_accepted, r.accept_hist) for r in got] == \
               [(r.tokens, r.steps, r.n_accepted, r.accept_hist) for r in ref]


def test_ngram_tree_greedy_equals_target_only(smol, target_only) -> None:
    """An n-gram draft tree (3 continuations, 4 deep) in the reference stepper and the captured
    stepper (eager, chunks of 1 and 4) gives the target's greedy tokens, with an EOS and a budget
    inside accepted runs; both loops take the same steps and accept the same counts, and the
    tree accepts more than the n-gram chain of its depth (its other branches are used)."""
    model, tok, prompts, _ = smol
    _, eos, ar_eos = target_only
    ref = [r.tokens for r in ar_eos]
    ngram = NgramDrafter()
    tree = SpecEngine(model, [Arm("ngram", tree=TreeShape.parse("3x1x1x1"))], drafters=[ngram], eos_ids=eos
                      ).generate(prompts, 37).rows
    chain = SpecEngine(model, [Arm("ngram", 4)], drafters=[ngram], eos_ids=eos).generate(prompts, 37).rows
    assert [r.tokens for r in tree] == ref == [r.tokens for r in chain]
    assert sum(r.n_accepted for r in tree) > sum(r.n_accepted for r in chain)
    for chunk in (1, 4):
        engine = SpecEngine(model, [Arm("ngram", tree=TreeShape.parse("3x1x1x1"))], drafters=[ngram],
                            eos_ids=eos, resident=True, chunk=chunk)
        engine.min_capacity = 256
        got = engine.generate(prompts, 37).rows
        assert [(r.tokens, r.steps, r.n_accepted, r.accept_hist) for r in got] == \
               [(r.tokens, r.steps, r.n_accepted, r.accept_hist) for r in tree]


@pytest.mark.parametrize("chunk", [1, 4])
def test_tree_drafted_ahead_equals_reference_loop(smol, target_only, eagle_tree, overlapped,
                                                  chunk) -> None:
    """Driven as on a GPU (each chunk's first tree drafted before the host reads the chunk in
    flight), a resident tree arm gives the reference stepper's tokens, steps, accepted counts and
    histograms, an EOS inside accepted runs included."""
    model, tok, prompts, eagle = smol
    _, eos, _ = target_only
    arms = [Arm("eagle", tree=TreeShape.parse("dyn12"))]
    ref = eagle_tree("dyn12")    # the reference stepper (overlapped drives only resident loops ahead)
    engine = SpecEngine(model, arms, drafters=[eagle], eos_ids=eos, resident=True, chunk=chunk)
    engine.min_capacity = 256
    got = engine.generate(prompts, 37).rows
    assert [(r.tokens, r.steps, r.n_accepted, r.accept_hist) for r in got] == \
           [(r.tokens, r.steps, r.n_accepted, r.accept_hist) for r in ref]


def test_resident_sampled_and_planned_trees(smol) -> None:
    """Sampled trees draw children from counter-based streams of the step's seed: a resident
    run does not depend on its chunking. With the planner a tree arm is all or nothing, and
    greedy output stays the target's."""
    from flashspec.planner import WidthPlanner
    model, tok, prompts, eagle = smol
    arms = [Arm("eagle", tree=TreeShape.parse("2x2"))]
    runs = []
    for chunk in (1, 5):
        engine = SpecEngine(model, arms, drafters=[eagle], params=SamplingParams(temperature=1.0),
                            resident=True, chunk=chunk, seed=3)
        engine.min_capacity = 256
        runs.append([(r.tokens, r.n_accepted) for r in engine.generate(prompts, 24).rows])
    assert runs[0] == runs[1] and sum(n for _, n in runs[0]) > 0
    ar = SpecEngine(model, [Arm()]).generate(prompts, 24).rows
    planner = WidthPlanner(explore=1)
    engine = SpecEngine(model, arms, drafters=[eagle], planner=planner, resident=True, chunk=2)
    engine.min_capacity = 256
    assert [r.tokens for r in engine.generate(prompts, 24).rows] == [r.tokens for r in ar]
    assert planner.tree_seen.get(arms[0]) and planner.seen.get(0), "tree and plain steps probed"


def test_planner_plays_a_tree_only_while_it_beats_the_chain() -> None:
    """plan_tree: the chain widths 0, γ/2 and γ of the tree's drafter are measured first, then
    the tree; then the tree plays while its tokens per second (mean accepted + 1 over its step
    cost) beat the best chain's value, and a losing tree is re-probed after ``reprobe``
    decisions against it (the alternative is the chain, not a plain step, when the chain pays)."""
    from flashspec.planner import WidthPlanner
    planner = WidthPlanner(explore=1, replan=1)
    planner.reset(2)
    live = [5, 5]
    tree = Arm("eagle", tree=TreeShape.parse("dyn4d2"))          # depth 2
    for k in (0, 1, 2):                                          # the chain's probe widths
        assert planner.plan_tree(tree, live) == k
        planner.observe_counts(k, 0.010 + 0.001 * k, [k, k], [k, k])   # all accepted
    assert planner.plan_tree(tree, live) is None            # then the tree's
    planner.observe_tree_counts(tree, 0.014, 4, 2)    # 3 tokens per 14 ms
    # beats a plain step (1 per 10 ms), not the chain at γ = 2 (α ≈ 0.9: ~2.7 tokens per 12 ms)
    assert planner.plan_tree(tree, live) == 2
    for _ in range(5):
        planner.observe_tree_counts(tree, 0.010, 8, 2)  # now ~5 tokens per 10 ms
    assert planner.plan_tree(tree, live) is None
    for _ in range(20):
        planner.observe_tree_counts(tree, 0.030, 0, 2)  # slower, nothing accepted
    plays = [planner.plan_tree(tree, live) for _ in range(2 * planner.reprobe + 2)]
    assert plays.count(None) == 2 and plays.index(None) == planner.reprobe, \
        "a losing tree is re-probed once after `reprobe` decisions against it"
    assert {k for k in plays if k is not None} == {2}, "the chain, not a plain step, stands in"


def test_tree_arm_with_planner_keeps_greedy_output(smol) -> None:
    from flashspec.planner import WidthPlanner
    model, tok, prompts, eagle = smol
    ar = SpecEngine(model, [Arm()]).generate(prompts[:2], 24).rows
    out = SpecEngine(model, [Arm("eagle", tree=TreeShape.parse("dyn4d4k2"))], drafters=[eagle],
                     planner=WidthPlanner(explore=1)).generate(prompts[:2], 24).rows
    assert [r.tokens for r in out] == [r.tokens for r in ar]
    assert set(a for r in out for a in r.arms) == {0}
