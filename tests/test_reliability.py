"""Issue 18, "nothing lost, nothing silently wrong": run records survive a crash mid-write, a run
directory has one writer and one config, caches are keyed by content, and bad inputs, files and
settings stop with one line naming them."""
from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashspec.errors import FlashSpecError
from flashspec.seeds import derive_seed
from flashspec.records import (RecordWriter, RunLock, check_resume, config_hash,
                               provenance, read_records)

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------ records
def test_torn_last_line_is_quarantined_and_never_merged(tmp_path, caplog):
    path = tmp_path / "records.jsonl"
    RecordWriter(path).write({"k": 1})
    with path.open("a") as f:                       # a crash mid-write: half a record
        f.write('{"k": 2, "tokens": [1, 2')
    with caplog.at_level(logging.WARNING):
        writer = RecordWriter(path)
        writer.write({"k": 3})
    assert [r["k"] for r in read_records(path)] == [1, 3]
    assert path.read_text().endswith("\n") and path.read_text().count("\n") == 2
    assert (tmp_path / "records.jsonl.torn").read_text() == '{"k": 2, "tokens": [1, 2\n'
    assert f"{path} line 2" in caplog.text


def test_complete_record_without_newline_is_kept(tmp_path, caplog):
    path = tmp_path / "r.jsonl"
    path.write_text('{"k": 1}\n{"k": 2}')            # crash between the record and its newline
    with caplog.at_level(logging.WARNING):
        RecordWriter(path).write({"k": 3})
    assert [r["k"] for r in read_records(path)] == [1, 2, 3]
    assert "line 2" in caplog.text and not (tmp_path / "r.jsonl.torn").exists()


def test_merged_line_is_reported_and_its_whole_record_kept(tmp_path, caplog):
    """A file written by the old writer: a torn record with the next record appended to it."""
    path = tmp_path / "r.jsonl"
    path.write_text('{"k": 1}\n{"k": 2, "text": "def f(): {' + '{"k": 3, "x": {"y": 1}}\n'
                    + 'garbage\n')
    with caplog.at_level(logging.WARNING):
        keys = [r["k"] for r in read_records(path)]
    assert keys == [1, 3]
    assert f"{path} line 2" in caplog.text and f"{path} line 3" in caplog.text


def test_gzipped_records_read_like_plain_ones(tmp_path):
    """Committed records too large to keep raw are stored as .jsonl.gz and read the same."""
    import gzip
    lines = "".join(json.dumps({"k": k}) + "\n" for k in range(3))
    (tmp_path / "r.jsonl").write_text(lines)
    with gzip.open(tmp_path / "r.jsonl.gz", "wt") as f:
        f.write(lines)
    assert list(read_records(tmp_path / "r.jsonl.gz")) == list(read_records(tmp_path / "r.jsonl"))
    assert [r["k"] for r in read_records(tmp_path / "r.jsonl.gz")] == [0, 1, 2]


def test_a_failed_write_leaves_no_partial_line(tmp_path):
    path = tmp_path / "r.jsonl"
    writer = RecordWriter(path)
    writer.write({"k": 1})
    with pytest.raises(TypeError):
        writer.write({"k": object()})
    writer.write({"k": 2})
    assert [r["k"] for r in read_records(path)] == [1, 2]


def test_run_lock_refuses_a_second_process_and_takes_over_a_dead_ones(tmp_path, caplog):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from flashspec.records import RunLock\n"
         f"with RunLock({str(tmp_path)!r}):\n    print('held', flush=True); sys.stdin.read()"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FlashSpecError, match=f"in use by process {holder.pid}"):
            RunLock(tmp_path).acquire()
    finally:
        holder.communicate("", timeout=60)
    assert not (tmp_path / ".flashspec.lock").exists()     # released on exit
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    import socket
    (tmp_path / ".flashspec.lock").write_text(f"{socket.gethostname()} {dead}\n")
    with caplog.at_level(logging.WARNING), RunLock(tmp_path) as lock:
        assert lock.held and f"process {dead}" in caplog.text
        with pytest.raises(FlashSpecError, match=f"process {os.getpid()}"):
            RunLock(tmp_path).acquire()
    assert not (tmp_path / ".flashspec.lock").exists()


CFG = {"seed": 0, "output_dir": "/a", "logger": {"mode": "offline"},
       "experiment": {"name": "decode", "temperature": 0.0, "records": "records.jsonl"},
       "dataset": {"name": "humaneval", "n_prompts": 8}}


def _with(**changes) -> dict:
    cfg = json.loads(json.dumps(CFG))
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = cfg
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def test_resume_refuses_another_config_naming_the_keys(tmp_path):
    assert check_resume(tmp_path, CFG).status == "new"
    assert json.loads((tmp_path / "run_config.json").read_text())["config"] == CFG
    RecordWriter(tmp_path / "records.jsonl").write({"k": 1})
    # cosmetic keys differ: same run
    assert check_resume(tmp_path, _with(output_dir="/b", logger__mode="disabled")).status == "same"
    other = _with(experiment__temperature=0.7, dataset__n_prompts=9)
    with pytest.raises(FlashSpecError, match=r"differs in: dataset\.n_prompts, "
                                             r"experiment\.temperature"):
        check_resume(tmp_path, other)
    with pytest.raises(FlashSpecError, match="resume mode"):
        check_resume(tmp_path, other, mode="yes")


def test_resume_accept_records_the_new_config(tmp_path):
    check_resume(tmp_path, CFG)
    other = _with(seed=1)
    info = check_resume(tmp_path, other, mode="accept")
    assert info.status == "accepted" and info.changed == ["seed"]
    assert json.loads((tmp_path / "run_config.json").read_text())["config"] == other
    history = [json.loads(x) for x in (tmp_path / "run_config_history.jsonl").read_text().splitlines()]
    assert history[0]["config"] == CFG and history[0]["changed"] == ["seed"]
    assert check_resume(tmp_path, other).status == "same"


def test_resume_fresh_moves_the_old_run_aside(tmp_path):
    check_resume(tmp_path, CFG)
    RecordWriter(tmp_path / "records.jsonl").write({"k": 1})
    (tmp_path / ".hydra").mkdir()
    with RunLock(tmp_path):
        info = check_resume(tmp_path, _with(seed=1), mode="fresh")
        assert (tmp_path / ".flashspec.lock").exists()
    assert info.status == "fresh" and info.archived.parent == tmp_path
    assert list(read_records(info.archived / "records.jsonl")) == [{"k": 1}]
    assert not (tmp_path / "records.jsonl").exists() and (tmp_path / ".hydra").is_dir()
    assert json.loads((tmp_path / "run_config.json").read_text())["config"]["seed"] == 1


def test_resume_refuses_records_without_a_stored_config(tmp_path):
    RecordWriter(tmp_path / "records.jsonl").write({"k": 1})
    with pytest.raises(FlashSpecError, match="no run_config.json"):
        check_resume(tmp_path, CFG)
    assert check_resume(tmp_path, CFG, mode="accept").status == "accepted"


def test_hashes_and_provenance():
    h = config_hash(CFG)
    assert len(h) == 64 and h == config_hash(json.loads(json.dumps(CFG)))
    assert config_hash(dict(reversed(list(CFG.items())))) == h           # key order
    assert config_hash(_with(output_dir="/elsewhere")) == h             # cosmetic key
    assert config_hash(_with(seed=1)) != h
    assert config_hash(_with(output_dir="/x"), ignore=()) != config_hash(CFG, ignore=())
    prov = provenance(CFG, 3, data_hash="d" * 64)
    assert prov["config_hash"] == h and prov["data_hash"] == "d" * 64 and prov["seed"] == 3
    assert derive_seed(0, ("spec", "humaneval/1", 0)) == derive_seed(0, ("spec", "humaneval/1", 0))
    assert len({derive_seed(s, ("m", p)) for s in (0, 1) for p in ("a", "b")}) == 4
    assert 0 <= derive_seed(5, "x") < 2 ** 32


# ----------------------------------------------------------------------------- sampling, inputs
@pytest.mark.parametrize("kw", [dict(top_k=2.5), dict(top_k=True), dict(top_k=-1),
                                dict(temperature=math.inf), dict(temperature=math.nan),
                                dict(temperature=-0.5), dict(temperature=1e-38),
                                dict(temperature=True), dict(top_p=math.nan), dict(top_p=0.0)])
def test_sampling_params_reject(kw):
    from flashspec.core import SamplingParams
    with pytest.raises(FlashSpecError):
        SamplingParams(**kw)


def test_smallest_temperature_stays_finite_in_every_dtype():
    from flashspec.core import SamplingParams, T_MIN
    from flashspec.verify.sampling import sample, warp_logprobs
    params = SamplingParams(temperature=T_MIN, top_k=3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = (torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 1e4)
        logits = logits.to(dtype)
        assert torch.isfinite(warp_logprobs(logits, params).exp().sum(-1)).all()
        for seed in (None, torch.tensor(5)):       # multinomial and counter-based Gumbel-max
            tok = sample(logits, params, torch.Generator().manual_seed(1), seed)
            assert torch.equal(tok, logits.float().argmax(-1))      # greedy-equivalent


@pytest.mark.parametrize("prompts, match", [
    ([], "empty"), ("hello", "tokenize"), ([[]], "empty prompt: prompt 0"), ([[1], torch.tensor([], dtype=torch.long)], "prompt 1 has shape"),
    ([[1, 2], [3, 2.0]], r"prompt 1 position 1 is 2\.0"), ([[1, True]], "position 1 is True"),
    ([[1, 100]], "token id 100, outside"), ([[-1]], "token id -1"), (["abc"], "tokenize"),
    ([torch.tensor([1.0, 2.0])], "float32 tensor"), ([torch.tensor([[1, 2]])], "shape"),
    ([torch.tensor([1, 2, 100])], "position 2 is token id 100"),
])
def test_check_prompts_rejects(prompts, match):
    from flashspec.inputs import check_prompts
    with pytest.raises(FlashSpecError, match=match):
        check_prompts(prompts, vocab_size=100)


def test_check_inputs_accept_and_max_new_tokens():
    from flashspec.inputs import check_generate_inputs, check_max_new_tokens, check_prompts
    check_prompts([[0, 99], (5,), torch.tensor([1, 2], dtype=torch.int32)], vocab_size=100)
    check_generate_inputs([[1]], 3, 100)
    for bad in (0, -1, 2.0, True, "4", None):
        with pytest.raises(FlashSpecError, match="max_new_tokens"):
            check_max_new_tokens(bad)


def test_engine_generate_checks_its_inputs():
    from flashspec.core import Arm
    from flashspec.engine import SpecEngine
    from flashspec.models.loading import dummy_config, random_model
    cfg = dummy_config("smollm2-135m")
    cfg.num_hidden_layers, cfg.vocab_size = 1, 64
    model = random_model(cfg, torch.float32, "cpu")
    engine = SpecEngine(model, [Arm()])
    with pytest.raises(FlashSpecError, match="token id 64, outside"):
        engine.generate([[1, 64]], 4)
    with pytest.raises(FlashSpecError, match="max_new_tokens"):
        engine.generate([[1, 2]], 2.5)
    assert len(engine.generate([[1, 2]], 3).rows[0].tokens) <= 3


# ------------------------------------------------------------------------------------ prompt data
@pytest.fixture()
def humaneval_cache(tmp_path, monkeypatch) -> Path:
    """A private prompt cache holding HumanEval, written by the real prepare script."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("prepare_data", ROOT / "scripts/prepare_data.py")
    prepare_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare_data)
    monkeypatch.setenv("FLASHSPEC_DATA", str(tmp_path))
    prepare_data.prepare(tmp_path, ("humaneval",))
    return tmp_path


def _rewrite_row0(folder: Path, edit, update_manifest: bool) -> Path:
    from flashspec.data import file_sha256
    path = folder / "humaneval.jsonl"
    lines = path.read_text().splitlines()
    row = json.loads(lines[0])
    edit(row)
    lines[0] = json.dumps(row)
    path.write_text("\n".join(lines) + "\n")
    if update_manifest:
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["humaneval"]["sha256"] = file_sha256(path)
        (folder / "manifest.json").write_text(json.dumps(manifest))
    return path


def test_data_hash_names_the_prompt_files(humaneval_cache):
    from flashspec.data import data_hash, load_prompts
    h = data_hash("humaneval")
    assert len(h) == 64 and h == data_hash(["humaneval"]) and load_prompts("humaneval", 2)
    _rewrite_row0(humaneval_cache, lambda r: r.update(prompt=r["prompt"] + "# x\n"), True)
    assert data_hash("humaneval") != h


def test_prompt_file_changed_after_prepare_is_refused(humaneval_cache):
    from flashspec.data import load_prompts
    path = _rewrite_row0(humaneval_cache, lambda r: r.update(prompt=r["prompt"] + "# x\n"), False)
    with pytest.raises(FlashSpecError, match=f"{path} differs from .*manifest.json"):
        load_prompts("humaneval", 2)


def test_prompt_row_without_its_text_is_named(humaneval_cache):
    from flashspec.data import load_prompts
    path = _rewrite_row0(humaneval_cache, lambda r: r.pop("prompt"), True)
    with pytest.raises(FlashSpecError, match=f"{path} row 1 has no 'prompt' field"):
        load_prompts("humaneval", 2)


# ------------------------------------------------------------------------ model files and caches
def _write_gguf(path: Path, seed: int, vocab: int = 300, d: int = 16, ff: int = 32) -> Path:
    """A tiny but real Llama GGUF (byte-level BPE vocabulary, float32 tensors)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np
    from tokenizers.pre_tokenizers import ByteLevel
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1), w.add_context_length(64), w.add_embedding_length(d)
    w.add_feed_forward_length(ff), w.add_head_count(2), w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5), w.add_rope_dimension_count(d // 2)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default")
    tokens = sorted(ByteLevel.alphabet()) + [f"<x{i}>" for i in range(vocab - 256)]
    w.add_token_list(tokens), w.add_token_types([1] * vocab), w.add_token_scores([0.0] * vocab)
    w.add_token_merges([]), w.add_bos_token_id(256), w.add_eos_token_id(257)
    mat = lambda *shape: (rng.standard_normal(shape) * 0.02).astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", mat(vocab, d))
    w.add_tensor("output.weight", mat(vocab, d))
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    for name, shape in [("attn_q", (d, d)), ("attn_k", (d, d)), ("attn_v", (d, d)),
                        ("attn_output", (d, d)), ("ffn_gate", (ff, d)), ("ffn_up", (ff, d)),
                        ("ffn_down", (d, ff))]:
        w.add_tensor(f"blk.0.{name}.weight", mat(*shape))
    for name in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{name}.weight", np.ones(d, np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    """Two different GGUF files of the same name, converted in a private model cache."""
    from flashspec.models.loading import load_model
    root = tmp_path_factory.mktemp("gguf")
    a, b = _write_gguf(root / "a" / "model.gguf", 0), _write_gguf(root / "b" / "model.gguf", 1)
    mp = pytest.MonkeyPatch()
    mp.setenv("FLASHSPEC_CACHE", str(root / "cache"))
    models = {p: load_model(str(p))[0] for p in (a, b)}
    yield root, a, b, models
    mp.undo()


def test_gguf_cache_is_keyed_by_content(tiny_ggufs):
    from flashspec.models.loading import gguf_cache_dir, gguf_key, load_model
    root, a, b, models = tiny_ggufs
    assert gguf_key(a)["size"] == a.stat().st_size and gguf_key(a) != gguf_key(b)
    assert gguf_cache_dir(a) != gguf_cache_dir(b)
    wa, wb = (models[p].embed_tokens.weight for p in (a, b))
    assert not torch.equal(wa, wb)                          # b/model.gguf is not a's model
    again = load_model(str(b))[0]                           # from the cache this time
    assert torch.equal(again.embed_tokens.weight, wb)


def test_stale_gguf_conversion_is_rebuilt(tiny_ggufs, caplog):
    from flashspec.models.loading import cached_conversion, gguf_cache_dir, load_model
    root, a, b, models = tiny_ggufs
    stamp = gguf_cache_dir(a) / "source.json"
    stamp.write_text(json.dumps({"size": 1, "sha256": "0" * 64}))   # e.g. a prefix collision
    assert cached_conversion(a) is None
    with caplog.at_level(logging.WARNING):
        model = load_model(str(a))[0]
    assert "stale" in caplog.text and cached_conversion(a) == gguf_cache_dir(a)
    assert torch.equal(model.embed_tokens.weight, models[a].embed_tokens.weight)


def test_invalid_gguf_is_one_line_naming_the_file(tiny_ggufs):
    from flashspec.models.loading import load_model
    root, a, b, models = tiny_ggufs
    bad = root / "c" / "model.gguf"
    bad.parent.mkdir()
    bad.write_bytes(a.read_bytes()[: a.stat().st_size // 3])     # truncated download
    with pytest.raises(FlashSpecError) as e:
        load_model(str(bad))
    assert str(bad) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("damage, match", [
    (lambda c: None, "config.json not found"),
    (lambda c: "{\"model_type\": \"llama\", ", "not valid JSON"),
    (lambda c: {**c, "vocab_size": None}, "vocab_size missing or not a positive integer"),
    (lambda c: {**c, "hidden_size": 15, "head_dim": None}, "not a multiple of num_attention_heads"),
    (lambda c: {**c, "model_type": "gpt2"}, "model_type 'gpt2' has no native path"),
    (lambda c: {**c, "vocab_size": 301}, "do not fit its config.json"),
])
def test_broken_model_config_is_one_line_naming_it(tiny_ggufs, tmp_path, damage, match):
    import shutil
    from flashspec.models.loading import gguf_cache_dir, load_model
    root, a, b, models = tiny_ggufs
    folder = tmp_path / "model"
    shutil.copytree(gguf_cache_dir(a), folder)
    config = json.loads((folder / "config.json").read_text())
    new = damage(config)
    (folder / "config.json").unlink()
    if new is not None:
        (folder / "config.json").write_text(new if isinstance(new, str) else json.dumps(new))
    with pytest.raises(FlashSpecError, match=match) as e:
        load_model(str(folder))
    assert str(folder) in str(e.value) and "\n" not in str(e.value)


# -------------------------------------------------------------------------- drafter checkpoints
def _tiny_target(vocab: int = 64):
    from flashspec.models.loading import dummy_config, random_model
    cfg = dummy_config("smollm2-135m")
    cfg.num_hidden_layers, cfg.vocab_size = 1, vocab
    return random_model(cfg, torch.float32, "cpu")


@pytest.fixture()
def eagle_ckpt(tmp_path):
    from flashspec.drafters.eagle_module import EagleConfig, EagleModule
    from flashspec.drafters.eagle_checkpoint import save_eagle
    target = _tiny_target()
    module = EagleModule(target.shape, EagleConfig(n_layers=1))
    module.init_weights(generator=torch.Generator().manual_seed(0))
    return target, module, save_eagle(tmp_path / "e.safetensors", module, target,
                                      dtype=torch.float32)


def _one_line_error(fn, *args, match: str, path: Path) -> None:
    with pytest.raises(FlashSpecError, match=match) as e:
        fn(*args)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_truncated_drafter_checkpoint(eagle_ckpt):
    from flashspec.drafters.eagle_checkpoint import load_eagle
    target, module, path = eagle_ckpt
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])          # header intact, tensor data cut
    _one_line_error(load_eagle, path, target, match="truncated", path=path)
    path.write_bytes(data[:6])                          # not even a header
    _one_line_error(load_eagle, path, target, match="truncated or not a safetensors", path=path)


def test_mis_shaped_and_nan_drafter_checkpoints(eagle_ckpt, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file
    from flashspec.drafters.eagle_checkpoint import load_eagle, save_eagle
    target, module, path = eagle_ckpt
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    bad = tmp_path / "bad.safetensors"
    save_file({**tensors, "module.fc.weight": tensors["module.fc.weight"][:, :-1].contiguous()},
              str(bad), metadata=meta)
    _one_line_error(load_eagle, bad, target, match="does not match its own config", path=bad)
    save_file({k: v for k, v in tensors.items() if "layers.0.mlp" not in k}, str(bad),
              metadata=meta)
    _one_line_error(load_eagle, bad, target, match="does not match its own config", path=bad)
    with torch.no_grad():
        module.layers[0].mlp.down_proj.weight[3, 5] = float("nan")
    nan = save_eagle(tmp_path / "nan.safetensors", module, target, dtype=torch.float32)
    _one_line_error(load_eagle, nan, target, match="NaN or inf weights in module.layers.0.mlp",
                    path=nan)


def test_drafters_package_does_not_import_training():
    code = ("import sys, flashspec.drafters.eagle, flashspec.drafters.eagle_checkpoint; "
            "bad = [m for m in sys.modules if m.startswith('flashspec.training')]; "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    for src in (ROOT / "flashspec" / "drafters").glob("*.py"):
        assert "flashspec.training" not in src.read_text(), src


def test_eagle_drafter_build_loads_through_the_new_module(eagle_ckpt):
    from flashspec.drafters import DraftContext
    from flashspec.drafters.eagle import EagleDrafter
    target, module, path = eagle_ckpt
    drafter = EagleDrafter.build(DraftContext(target), "e", checkpoint=str(path))
    assert torch.equal(drafter.module.fc.weight, module.fc.weight)


# --------------------------------------------------------------------------------- CPU matmul
def test_matmul_form_is_measured_once_and_cached_per_machine(tmp_path, monkeypatch):
    from flashspec import matmul
    monkeypatch.setenv("FLASHSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(matmul, "_choices", None)
    w = torch.randn(300, 64)
    form = matmul.choose_form(3, w)
    assert form in matmul.FORMS
    blob = json.loads(matmul.cache_file().read_text())
    assert blob["choices"] == {"float32:r3:300x64": form}
    assert blob["machine"]["torch"] == torch.__version__ and blob["machine"]["cores"]
    monkeypatch.setattr(matmul, "_choices", None)        # a new process: read from disk
    timed = []
    monkeypatch.setattr(matmul, "measure", lambda rows, w: timed.append(rows) or "xwt")
    assert matmul.choose_form(3, w) == form and not timed  # no new timing
    # every row count has its own choice: the fast form can change from one count to the next
    assert matmul.choose_form(4, w) == "xwt" and timed == [4]
    assert set(json.loads(matmul.cache_file().read_text())["choices"]) == {
        "float32:r3:300x64", "float32:r4:300x64"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_both_matmul_forms_give_the_same_product(tmp_path, monkeypatch, dtype, rows):
    from flashspec import matmul
    monkeypatch.setenv("FLASHSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(matmul, "_choices", None)
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(70, 33, generator=g).to(dtype), torch.randn(70, generator=g).to(dtype)
    x = torch.randn(2, rows // 2 or 1, 33, generator=g).to(dtype) if rows > 1 else \
        torch.randn(1, 1, 33, generator=g).to(dtype)
    want = torch.nn.functional.linear(x, w, b)
    for form in (None, "xwt", "wxt"):
        torch.testing.assert_close(matmul.linear(x, w, b, form=form), want)
    try:
        matmul.pin_form("wxt")
        torch.testing.assert_close(matmul.linear(x, w, b), want)
    finally:
        matmul.pin_form(None)
    with pytest.raises(FlashSpecError, match="matmul form"):
        matmul.linear(x, w, b, form="fast")
