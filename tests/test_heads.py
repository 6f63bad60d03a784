"""Drafter heads: full / low-rank (SlimSpec) / truncated, distillation, I/O, head_bench smoke."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from flashspec.matmul import linear
import torch

from flashspec.errors import FlashSpecError
from flashspec.heads import (FullHead, FullHeadChoice, LowRankChoice, LowRankHead,
                             TruncatedChoice, TruncatedHead, agreement_metrics, distill_lowrank,
                             equal_cost_keep, evaluate_head, load_frequencies, load_head,
                             resolve_keep, resolve_rank, save_frequencies, save_head,
                             token_frequencies)
from flashspec.theory import equal_cost_rank, lowrank_cost_ratio

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(300, 48, generator=g, dtype=torch.float64)


def test_full_head_is_plain_matmul(weight):
    h = torch.randn(2, 3, 48, dtype=torch.float64)
    head = FullHead(weight)
    torch.testing.assert_close(head(h), h @ weight.T, rtol=1e-12, atol=1e-12)  # few-row CPU path
    big = torch.randn(40, 48, dtype=torch.float64)  # more rows than SMALL_ROWS: plain F.linear
    assert torch.equal(head(big), big @ weight.T)
    assert head.weight_bytes() == 300 * 48 * 8 and head.flops_per_token() == 2 * 300 * 48


def test_svd_at_full_rank_reproduces_full_head(weight):
    h = torch.randn(5, 48, dtype=torch.float64)
    head = LowRankHead.from_svd(weight, 48)
    torch.testing.assert_close(head(h), h @ weight.T, rtol=1e-10, atol=1e-10)
    calib = LowRankHead.from_svd(weight, 48, calibration=torch.randn(200, 48, dtype=torch.float64))
    torch.testing.assert_close(calib(h), h @ weight.T, rtol=1e-8, atol=1e-8)


def test_svd_is_best_rank_r_and_activation_aware_wins_on_its_data(weight):
    scale = torch.linspace(0.05, 3.0, 48, dtype=torch.float64)
    x = torch.randn(2000, 48, dtype=torch.float64) * scale
    plain, aware = LowRankHead.from_svd(weight, 8), LowRankHead.from_svd(weight, 8, x)
    s = torch.linalg.svdvals(weight)
    w_hat = plain.w_up @ plain.w_down
    torch.testing.assert_close(torch.linalg.matrix_norm(weight - w_hat) ** 2, (s[8:] ** 2).sum())
    err = lambda hd: float(((x @ weight.T - hd(x).detach()) ** 2).mean())  # noqa: E731
    assert err(aware) < 0.9 * err(plain)


def test_lowrank_cost(weight):
    head = LowRankHead.from_svd(weight, 6)
    assert head.rank == 6 and head.w_down.shape == (6, 48) and head.w_up.shape == (300, 6)
    assert head.flops_per_token() == 2 * 6 * (48 + 300)
    assert head.weight_bytes() / FullHead(weight).weight_bytes() == pytest.approx(
        lowrank_cost_ratio(6, 300, 48))


@pytest.mark.parametrize("rank", [0, -3, 49, 1000])
def test_rank_out_of_range_is_flashspec_error(weight, rank):
    with pytest.raises(FlashSpecError):
        LowRankHead.from_svd(weight, rank)
    with pytest.raises(FlashSpecError):   # refused when chosen, or against d when built
        LowRankChoice(rank=rank, init="svd").build(weight)
    with pytest.raises(FlashSpecError):
        resolve_rank(rank, 48)


@pytest.mark.parametrize("rank", ["d/0", "d/100", "2d", "x/8"])
def test_bad_rank_strings_are_flashspec_errors(weight, rank):
    with pytest.raises(FlashSpecError):
        LowRankChoice(rank=rank, init="svd").build(weight)
    with pytest.raises(FlashSpecError):
        resolve_rank(rank, 48)


def test_truncated_head_exact_inside_neg_inf_outside(weight):
    keep = torch.tensor([3, 17, 42, 299, 0])
    head = TruncatedHead(weight, keep, 300)
    h = torch.randn(4, 48, dtype=torch.float64)
    z = head(h)
    assert z.shape == (4, 300)
    mask = torch.zeros(300, dtype=torch.bool)
    mask[keep] = True
    assert torch.isneginf(z[:, ~mask]).all()
    kept = linear(h, weight[keep])  # the kept rows' logits, placed at their ids bit for bit
    assert torch.equal(z[:, keep], kept)
    torch.testing.assert_close(z[:, mask], (h @ weight.T)[:, mask], rtol=1e-12, atol=1e-12)
    assert torch.equal(head.forward_kept(h), kept)
    assert head.flops_per_token() == 2 * 5 * 48


def test_truncated_from_frequencies_and_always_keep(weight):
    ids = [torch.tensor([5, 5, 5, 7, 7, 9, -1]), [7, 11]]
    freqs = token_frequencies(ids, 300)
    assert freqs[5] == 3 and freqs[7] == 3 and freqs[9] == 1 and freqs.sum() == 8
    head = TruncatedHead.from_frequencies(weight, freqs, 3)
    assert head.keep_ids.tolist() == [5, 7, 9]  # tie 9 vs 11 goes to the lower id
    head = TruncatedHead.from_frequencies(weight, freqs, 3, always_keep=[2])
    assert head.keep_ids.tolist() == [2, 5, 7]
    with pytest.raises(FlashSpecError):
        token_frequencies([[300]], 300)


def test_equal_cost_keep_matches_bytes():
    for d, vocab in [(576, 49152), (4096, 128256)]:
        for r in (d // 8, d // 32):
            k = equal_cost_keep(r, vocab, d)
            assert abs(k * d - r * (vocab + d)) <= d / 2
            assert equal_cost_rank(k, vocab, d) == r
    assert equal_cost_keep(576, 49152, 576) == 49152  # capped at V


def test_head_choices_build_each_kind(weight, tmp_path):
    assert FullHeadChoice().build(weight) is None   # the drafter keeps its own full head
    low = LowRankChoice(rank="d/8", init="svd").build(weight)
    assert isinstance(low, LowRankHead) and low.describe()["rank"] == 6
    assert LowRankChoice(rank="d/8").build(weight, {6: low}, drafter="x") is low   # init=trained
    freqs = torch.arange(300)
    trunc = TruncatedChoice(keep="match:d/8").build(weight, frequencies=freqs)
    assert trunc.keep == equal_cost_keep(6, 300, 48)
    assert set(trunc.keep_ids.tolist()) == set(range(300 - trunc.keep, 300))
    path = save_frequencies(freqs, tmp_path / "f.safetensors", {"text": "test"})
    from_file = TruncatedChoice(keep=0.1, frequencies=str(path)).build(weight)
    assert from_file.keep == 30
    assert resolve_keep(17, 300, 48) == 17 and resolve_keep("0.5", 300, 48) == 150
    for bad in (lambda: FullHeadChoice(rank="d/8"),                 # contradictions, when chosen
                lambda: TruncatedChoice(rank="d/8"),
                lambda: TruncatedChoice(keep=10).build(weight),     # no frequencies
                lambda: TruncatedChoice(keep=0, frequencies=str(path)).build(weight),
                lambda: LowRankChoice(rank=None),
                lambda: LowRankChoice(rank=4, init="asvd").build(weight),   # no calibration
                lambda: LowRankChoice(rank=4, init="random"),
                lambda: LowRankChoice(rank=4).build(weight, {6: low}),  # no trained head of rank 4
                lambda: LowRankChoice(rank=4, layout="diagonal")):
        with pytest.raises(FlashSpecError):
            bad()


def test_save_load_round_trip(weight, tmp_path):
    low = LowRankHead.from_svd(weight.float(), 5)
    low.distill_info = {"train_prompt_ids": ["a", "b"], "distill_steps": 3}
    path = save_head(low, tmp_path / "low.safetensors", {"seed": 7, "commit": "abc"})
    back, meta = load_head(path)
    h = torch.randn(3, 48)
    assert isinstance(back, LowRankHead) and torch.equal(back(h), low(h))
    assert meta["seed"] == 7 and meta["commit"] == "abc" and meta["rank"] == 5
    assert meta["train_prompt_ids"] == ["a", "b"] and meta["distill_steps"] == 3
    trunc = TruncatedHead(weight.float(), [1, 5, 9], 300)
    back, meta = load_head(save_head(trunc, tmp_path / "t.safetensors"))
    assert torch.equal(back(h), trunc(h)) and meta["keep"] == 3
    assert torch.equal(LowRankChoice(rank=5, checkpoint=str(path)).build(weight.float())(h), low(h))
    with pytest.raises(FlashSpecError):
        LowRankChoice(rank=6, checkpoint=str(path)).build(weight.float())
    with pytest.raises(FlashSpecError):
        load_head(tmp_path / "missing.safetensors")
    counts, meta = load_frequencies(save_frequencies(torch.tensor([0, 4, 1]), tmp_path / "c.st"))
    assert counts.tolist() == [0, 4, 1] and meta["total"] == 5


def test_in_out_layout_same_logits_transposed_storage(weight, tmp_path):
    h = torch.randn(4, 48, dtype=torch.float64)
    low = LowRankHead.from_svd(weight, 6)
    for head, ref in ((FullHead(weight, "in_out"), FullHead(weight)),
                      (LowRankHead.from_svd(weight, 6, layout="in_out"), low),
                      (TruncatedHead(weight, [4, 8, 15], 300, layout="in_out"),
                       TruncatedHead(weight, [4, 8, 15], 300))):
        assert head.describe()["layout"] == "in_out" and ref.describe()["layout"] == "out_in"
        torch.testing.assert_close(head(h), ref(h), rtol=1e-12, atol=1e-12)
    back, meta = load_head(save_head(LowRankHead.from_svd(weight, 6, layout="in_out"),
                                     tmp_path / "io.safetensors"))
    assert meta["layout"] == "in_out" and back.describe()["layout"] == "in_out"
    assert LowRankChoice(rank=6, init="svd", layout="in_out").build(weight
                                                                   ).describe()["layout"] == "in_out"
    with pytest.raises(FlashSpecError):
        FullHead(weight, "diagonal")


def test_distill_from_an_iterator_of_teacher_pairs():
    """Iterator input of (hidden, teacher input) pairs: a finite stream ends training early."""
    g = torch.Generator().manual_seed(1)
    teacher_w = torch.randn(200, 16, generator=g)
    head = LowRankHead.from_svd(torch.randn(200, 16, generator=g), 4)
    hidden = torch.randn(512, 16, generator=g)
    held = torch.randn(256, 16, generator=g)
    stream = ((hidden[i:i + 64], hidden[i:i + 64]) for i in range(0, 512, 64))  # 8 batches
    curve = distill_lowrank(head, stream, lambda z: z @ teacher_w.T, steps=50, lr=2e-2,
                            eval_hidden=held, eval_teacher_inputs=held, progress=False,
                            teacher_name="synthetic")
    assert [c["step"] for c in curve] == list(range(9))
    assert curve[-1]["eval_kl"] < curve[0]["eval_kl"]
    assert head.distill_info["distill_steps"] == 8 and head.distill_info["teacher"] == "synthetic"


def test_distill_rejects_overlapping_prompt_ids(weight):
    head = LowRankHead.from_svd(weight.float(), 4)
    with pytest.raises(FlashSpecError):
        distill_lowrank(head, torch.randn(8, 48), FullHead(weight.float()), 1,
                        train_prompt_ids=["p1", "p2"], eval_prompt_ids=["p2"], progress=False)


@pytest.fixture(scope="module")
def smol_states():
    """Real SmolLM2 layer-skip (first 10 layers) hidden states on disjoint train/eval prompts."""
    from flashspec.data import chat_ids, load_prompts
    from flashspec.heads.hidden import collect_states
    from flashspec.models import load_model
    model, tok = load_model("smollm2")
    out = {}
    for split, n in (("train", 4), ("eval", 2)):
        prompts = load_prompts("mixed", n=n, split=split)
        ids = [chat_ids(tok, p.turns[:1], [])[-80:] for p in prompts]
        out[split] = collect_states(model, [i[:16] for i in ids], [i[16:] for i in ids], range(10),
                                    [p.id for p in prompts], progress=False)
    return model.lm_head_weight.detach(), out["train"], out["eval"]


def test_distillation_lowers_heldout_kl_on_smollm2(smol_states):
    weight, train, evals = smol_states
    assert not set(train.prompt_ids) & set(evals.prompt_ids)
    full = FullHead(weight)
    head = LowRankHead.from_svd(weight, 36)  # d/16
    before = evaluate_head(head, evals.drafter, full)
    curve = distill_lowrank(head, train.drafter, full, steps=10, lr=3e-3, batch_size=128,
                            eval_hidden=evals.drafter, train_prompt_ids=train.prompt_ids,
                            eval_prompt_ids=evals.prompt_ids, progress=False)
    after = evaluate_head(head, evals.drafter, full)
    assert curve[0]["step"] == 0 and curve[0]["eval_kl"] == pytest.approx(before["kl"], rel=1e-4)
    assert curve[-1]["step"] == 10 and curve[-1]["eval_kl"] == pytest.approx(after["kl"], rel=1e-4)
    assert after["kl"] < 0.7 * before["kl"], (before, after)
    assert head.distill_info["train_prompt_ids"] == train.prompt_ids
    m = agreement_metrics(head, evals.drafter, full, full, evals.target)
    assert 0 <= m["top1_target"] <= 1 and 0 < m["accept_t1"] <= 1
    assert m["kl_full"] == pytest.approx(after["kl"], rel=1e-4)
    assert m["full_mass_kept"] == pytest.approx(1.0, abs=1e-5)


def test_bench_rotates_weight_copies_and_sizes_them_past_the_cache():
    from flashspec.analysis.head_bench import Variant, n_copies
    seen: list[int] = []
    copies = [lambda x, i=i: seen.append(i) for i in range(3)]
    v = Variant("lowrank_d/8", "lowrank", 6, None, 8, copies, 100, 10)
    for _ in range(7):
        v(torch.zeros(1))
    assert seen == [0, 1, 2, 0, 1, 2, 0]
    assert n_copies(10 << 20, 64 << 20, 64) == 7 and n_copies(1 << 30, 64 << 20, 64) == 1
    assert n_copies(1, 64 << 20, 64) == 64
    # a captured graph: enough calls to amortise its launch, whole rounds over the copies
    from flashspec.analysis.head_bench import GRAPH_MIN_CALLS, graph_calls
    assert graph_calls(1, 1) == GRAPH_MIN_CALLS and graph_calls(3, 2) == GRAPH_MIN_CALLS
    assert graph_calls(1, 3) % 3 == 0 and graph_calls(1, 3) >= GRAPH_MIN_CALLS
    assert graph_calls(40, 64) == 64 and graph_calls(70, 64) == 128


def test_head_bench_smoke_through_hydra(tmp_path):
    cmd = [sys.executable, "run.py", "experiment=head_bench", "smoke=true", "logger=disabled",
           f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "head_bench.jsonl").open()]
    by = {r["variant"]: r for r in records}
    assert set(by) == {"full", "lowrank_d/8", "truncated_d/8"}
    assert by["full"]["nu"] == 1.0 and all(r["latency_us"] > 0 for r in records)
    assert by["truncated_d/8"]["keep"] == equal_cost_keep(72, 49152, 576)
    assert records[0]["provenance"]["commit"] and (tmp_path / "nu_vs_rank.png").is_file()


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17])
def test_few_row_linear_matches_f_linear(rows):
    """The CPU few-row path (W xT, a padded second column for one row) is the same product."""
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(70, 33, generator=g), torch.randn(70, generator=g)
    x = torch.randn(1, rows, 33, generator=g)
    torch.testing.assert_close(linear(x, w, b), torch.nn.functional.linear(x, w, b))
    xg = x.clone().requires_grad_(True)
    linear(xg, w).sum().backward()  # autograd takes F.linear
    torch.testing.assert_close(xg.grad, w.sum(0).expand_as(x))
