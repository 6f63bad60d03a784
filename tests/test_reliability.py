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
from flashspec.records import (RecordWriter, RunLock, check_resume, config_hash, derive_seed,
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
    assert derive_seed(0, "spec", "humaneval/1", 0) == derive_seed(0, "spec", "humaneval/1", 0)
    assert len({derive_seed(s, "m", p) for s in (0, 1) for p in ("a", "b")}) == 4
    assert 0 <= derive_seed(5, "x") < 2 ** 63


# ----------------------------------------------------------------------------- sampling, inputs
@pytest.mark.parametrize("kw", [dict(top_k=2.5), dict(top_k=True), dict(top_k=-1),
                                dict(temperature=math.inf), dict(temperature=math.nan),
                                dict(temperature=-0.5), dict(temperature=1e-38),
                                dict(temperature=True), dict(top_p=math.nan), dict(top_p=0.0)])
def test_sampling_params_reject(kw):
    from flashspec.verify.sampling import SamplingParams
    with pytest.raises(FlashSpecError):
        SamplingParams(**kw)


def test_smallest_temperature_stays_finite_in_every_dtype():
    from flashspec.verify.sampling import T_MIN, SamplingParams, sample
    params = SamplingParams(temperature=T_MIN, top_k=3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = (torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 1e4)
        logits = logits.to(dtype)
        tok, logp = sample(logits, params, torch.Generator().manual_seed(1))
        assert torch.isfinite(logp.exp().sum(-1)).all()
        assert torch.equal(tok, logits.float().argmax(-1))          # greedy-equivalent


@pytest.mark.parametrize("prompts, match", [
    ([], "empty"), ("hello", "tokenize"), ([[]], "prompt 0 is empty"),
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
    from flashspec.engine import Arm, SpecEngine
    from flashspec.models.loading import dummy_config, random_model
    cfg = dummy_config("smollm2-135m")
    cfg.num_hidden_layers, cfg.vocab_size = 1, 64
    model = random_model(cfg, torch.float32, "cpu")
    engine = SpecEngine(model, [Arm(None, 0)])
    with pytest.raises(FlashSpecError, match="token id 64, outside"):
        engine.generate([[1, 64]], 4)
    with pytest.raises(FlashSpecError, match="max_new_tokens"):
        engine.generate([[1, 2]], 2.5)
    assert len(engine.generate([[1, 2]], 3).rows[0].tokens) <= 3
