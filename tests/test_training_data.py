"""Drafter-training data plumbing without a model: self-written prompts (filters, provenance,
cache), job order under a time budget, the device-side collate and the data cache key."""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict

import pytest
import torch

from flashspec.data import GSM8K_INSTRUCTION, format_humaneval, split_ids
from flashspec.training import prompts as synth
from flashspec.training.data import (DataSpec, DistillData, FORMAT, job_groups, length_batches,
                                     train_prompts)
from flashspec.training.train import TrainConfig, collate, to_store


def test_clean_cuts_at_the_next_entry_and_rejects_unfinished():
    assert synth.clean(" How do volcanoes form under the sea?\n\nTopic: x") == \
        "How do volcanoes form under the sea?"
    assert synth.clean("Explain recursion with a short example.\nTopic: y") == \
        "Explain recursion with a short example."
    assert synth.clean("a request that never ends and keeps going") is None
    assert synth.clean("Too short.\n\n") is None
    assert synth.clean(None) is None
    stub = 'def f(x: int) -> int:\n    """ Double x.\n\n    >>> f(2)\n    4\n    """'
    assert synth.clean(stub + "\n\nTopic: z", code=True) == stub
    assert synth.clean("def f(x):\n    return x * 2 + 1\nTopic: z", code=True) is None


def test_seeds_are_category_balanced_few_shot_lists():
    draws = synth.seeds("selfchat", 16, random.Random(0))
    assert [d.category for d in draws[:8]] == list(synth.TOPICS)
    for d in draws:
        assert d.text.endswith(f"Topic: {d.topic}\nRequest:") and d.topic in synth.TOPICS[d.category]
        assert all(synth.EXAMPLES[d.category][j][1] in d.text for j in d.shots)
    math = synth.seeds("selfmath", 3, random.Random(0))
    assert all(d.text.endswith("\nProblem:") and d.category == "math" for d in math)
    code = synth.seeds("selfcode", 2, random.Random(0))
    assert all(d.text.endswith("\nFunction:\n") and "def " in d.text for d in code)
    with pytest.raises(Exception, match="unknown synthetic"):
        synth.seeds("nope", 1, random.Random(0))


def test_synth_prompts_filters_records_and_caches(monkeypatch, tmp_path):
    example = synth.EXAMPLES["writing"][0][1]
    canned = ["Write a limerick about a sleepy dog.\n\nTopic: a", "no end in sight at all here",
              "Write a limerick about a sleepy dog!\n\n", example + "\n\n",
              "How do tides depend on the moon and the sun?\n\n"] * 3

    def fake(target, tokenizer, texts, seed, batch_size, progress=True, max_new_tokens=80):
        return canned[:len(texts)]

    monkeypatch.setattr(synth, "write_requests", fake)
    got, prov = synth.synth_prompts(None, None, "selfchat", 2, 0, 8, tmp_path, "t")
    assert [p.turns[0] for p in got] == ["Write a limerick about a sleepy dog.",
                                         "How do tides depend on the moon and the sun?"]
    assert prov["kept"] == 2 and prov["rejected"]["copy"] >= 1 and prov["rejected"]["duplicate"] >= 1
    assert all(p.id.startswith("selfchat/0-") and p.dataset == "selfchat" for p in got)
    monkeypatch.setattr(synth, "write_requests", None)  # a second call must hit the cache
    again, prov2 = synth.synth_prompts(None, None, "selfchat", 2, 0, 8, tmp_path, "t")
    assert [p.turns for p in again] == [p.turns for p in got] and prov2 == prov
    monkeypatch.setattr(synth, "write_requests", fake)
    math, _ = synth.synth_prompts(None, None, "selfmath", 1, 0, 8, None, "t")
    assert math[0].turns == [f"{GSM8K_INSTRUCTION}\n\nWrite a limerick about a sleepy dog."]
    canned = ['def half(n: int) -> int:\n    """ Half of n.\n    >>> half(4)\n    2\n    """\nTopic: x']
    code, _ = synth.synth_prompts(None, None, "selfcode", 1, 0, 8, None, "t")
    assert code[0].turns == [format_humaneval(canned[0].removesuffix("\nTopic: x"))]
    assert code[0].domain == "code"


def test_train_prompts_mix_real_and_synthetic():
    spec = DataSpec(datasets={"gsm8k": 3, "selfchat": 2})
    calls = []

    def fake(name, n):
        calls.append((name, n))
        return ["s"] * n

    got = train_prompts(spec, fake)
    assert calls == [("selfchat", 2)] and got[3:] == ["s", "s"]
    assert not {p.id for p in got[:3]} & set(split_ids("gsm8k", "eval"))
    with pytest.raises(Exception, match="synthetic"):
        train_prompts(spec)


def test_job_groups_cover_every_job_once():
    class P:
        def __init__(self, i, d):
            self.id, self.dataset = f"{d}/{i}", d

    prompts = [P(i, "a") for i in range(5)] + [P(i, "b") for i in range(3)]
    spec = DataSpec(datasets={"a": None, "b": None}, samples={"a": 2, "b": 1})
    groups = job_groups(prompts, spec, 4)
    jobs = [(p.id, k) for g in groups for p, k in g]
    assert sorted(jobs) == sorted([(p.id, k) for p in prompts[:5] for k in range(2)] +
                                  [(p.id, 0) for p in prompts[5:]])
    assert [len(g) for g in groups] == [4, 4, 4, 1]


def test_length_batches_bound_rows_and_tokens():
    lengths = [10, 10, 20, 20, 30, 500]
    assert length_batches(range(6), lengths, rows=4, tokens=60) == [[0, 1, 2], [3, 4], [5]]
    assert length_batches(range(6), lengths, rows=2, tokens=10 ** 6) == [[0, 1], [2, 3], [4, 5]]


def test_cache_key_unchanged_without_a_budget():
    spec = DataSpec()
    old = {k: v for k, v in asdict(spec).items() if k not in ("time_budget_s", "engine_graphs")}
    blob = json.dumps({"spec": old, "target": "t", "format": FORMAT}, sort_keys=True)
    assert spec.key("t") == hashlib.sha256(blob.encode()).hexdigest()[:16]
    assert DataSpec(time_budget_s=10.0).key("t") != spec.key("t")
    assert DataSpec(engine_graphs=True).key("t") == spec.key("t")


def tiny_data(lengths: list[int], prompts: list[int], d: int = 6, k: int = 3) -> DistillData:
    gen = torch.Generator().manual_seed(0)
    n = sum(lengths)
    offsets = torch.tensor([0] + lengths).cumsum(0)
    return DistillData(torch.randint(0, 50, (n,), generator=gen), offsets, torch.tensor(prompts),
                       torch.randn(n, d, generator=gen).half(),
                       torch.randint(0, 50, (n, k), generator=gen, dtype=torch.int32),
                       torch.randn(n, k, generator=gen), {})


@pytest.mark.parametrize("loss_on", ["response", "all"])
def test_collate_matches_a_per_row_reference(loss_on):
    data = tiny_data([5, 9, 3, 12], [2, 4, 1, 3])
    cfg = TrainConfig(max_len=10, batch_tokens=64, loss_on=loss_on)
    idx = [3, 0, 2]
    b = collate(to_store(data, "cpu"), idx, cfg)
    width = 10
    for r, i in enumerate(idx):
        lo, hi = data.span(i)
        n = min(hi - lo, cfg.max_len)
        assert b.tokens.shape == (3, width)
        assert torch.equal(b.tokens[r, :n], data.tokens[lo:lo + n]) and not b.tokens[r, n:].any()
        assert torch.equal(b.feats[r, :n], data.features[lo:lo + n].float())
        assert not b.feats[r, n:].any()
        assert torch.equal(b.top_ids[r, :n], data.top_ids[lo:lo + n].long())
        assert torch.equal(b.top_logp[r, :n], data.top_logp[lo:lo + n])
        assert (b.top_logp[r, n:] == -1e4).all()
        first = int(data.n_prompt[i]) - 1 if loss_on == "response" else 0
        want = [first <= s < n for s in range(width)]
        assert b.region[r].tolist() == want and b.valid[r].tolist() == [s < n for s in range(width)]
    x = torch.randn(3, width, 4)
    assert torch.equal(b.rows(x, "region"), x[b.region])
    assert torch.equal(b.rows(x, "valid"), x[b.valid])
