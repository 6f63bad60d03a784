"""Issue 45, "nothing a user can type breaks it": config values typed at composition (before any
model loads), records read defensively (resume and scripts/collect.py through one reader), a
resumed run tied to its prompt data and saying what it keeps, head files checked for finite
weights. Each bad input is one line naming the key, file or line."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from experiments.harness import run_dir, validate
from experiments.schema import check_config
from flashspec.errors import FlashSpecError
from flashspec.records import RecordWriter, check_resume, read_records

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def composed(*overrides: str, output_dir: str = "/tmp/unused"):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        cfg.output_dir = output_dir
        del cfg["hydra"]   # as the task sees it
    return cfg


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------- config values, typed
# (overrides, the whole one-line error). Hydra types `2.5` as a float, `true` as a bool and
# `abc` as a string; each used to run (top_k 2.5 as 2, true as 1) or die in a traceback.
BAD_VALUES = [
    (["experiment.top_k=2.5"], "experiment.top_k must be an integer >= 0, got 2.5"),
    (["experiment.top_k=true"], "experiment.top_k must be an integer >= 0, got True"),
    (["experiment.top_k=abc"], "experiment.top_k must be an integer >= 0, got 'abc'"),
    (["experiment.top_k=-1"], "experiment.top_k must be an integer >= 0, got -1"),
    (["experiment.temperature=abc"], "experiment.temperature must be a finite number >= 0, got 'abc'"),
    (["experiment.temperature=nan"], "experiment.temperature must be a finite number >= 0, got nan"),
    (["experiment.temperature=inf"], "experiment.temperature must be a finite number >= 0, got inf"),
    (["experiment.temperature=false"], "experiment.temperature must be a finite number >= 0, got False"),
    (["experiment.top_p=0"], "experiment.top_p must be a number in (0, 1], got 0"),
    (["experiment.top_p=1.5"], "experiment.top_p must be a number in (0, 1], got 1.5"),
    (["experiment.batch_size=abc"], "experiment.batch_size must be an integer >= 1, got 'abc'"),
    (["experiment.reuse=maybe"], "experiment.reuse must be true or false, got 'maybe'"),
    (["seed=1.5"], "seed must be an integer >= 0, got 1.5"),
    (["smoke=1"], "smoke must be true or false, got 1"),
    (["dataset.n_prompts=2.5"], "dataset.n_prompts must be an integer >= 1 or null, got 2.5"),
    (["dataset.max_new_tokens=true"], "dataset.max_new_tokens must be an integer >= 1, got True"),
    (["runtime.cuda_graphs=abc"], "runtime.cuda_graphs must be true or false, got 'abc'"),
    (["bandit=ucb1", "bandit.c=abc"], "bandit.c must be a finite number >= 0, got 'abc'"),
    (["bandit=fixed", "bandit.arm=1.5"], "bandit.arm must be an integer >= 0, got 1.5"),
    (["planner=goodput", "planner.replan=0.5"], "planner.replan must be an integer >= 1, got 0.5"),
    (["drafters.gammas=[2.5]"], "drafters.gammas.0 must be an integer >= 1, got 2.5"),
    (["drafters.arms=[[ngram,2.5]]"], "drafters.arms: 2.5 for drafter 'ngram' is not a gamma "
                                      "(a positive int) nor a tree shape"),
    (["drafters.arms=[[ngram,true]]"], "drafters.arms: True for drafter 'ngram' is not a gamma "
                                       "(a positive int) nor a tree shape"),
    (["experiment=head_decode", "experiment.gamma=0"], "experiment.gamma must be an integer >= 1, got 0"),
    (["experiment=bandit_sim", "experiment.horizon=2.5"],
     "experiment.horizon must be an integer >= 1, got 2.5"),
    (["experiment=bandit_sim", "experiment.policies.ucb1.c=abc"],
     "experiment.policies.ucb1.c must be a finite number >= 0, got 'abc'"),
    (["experiment=head_bench", "experiment.shapes=[[576,1.5]]"],
     "experiment.shapes.0.1 must be an integer >= 1, got 1.5"),
    (["experiment=kernel_bench", "experiment.iters=abc"], "experiment.iters must be an integer >= 1, got 'abc'"),
    (["experiment=train_drafter", "experiment.train.lr=-1"],
     "experiment.train.lr must be a finite number > 0, got -1"),
    (["experiment=train_drafter", "experiment.data.top_k=0.5"],
     "experiment.data.top_k must be an integer >= 0, got 0.5"),
    (["experiment=mixed_stream", "experiment.extra_bandits.sw_ucb_tps.reward_scale=0"],
     "experiment.extra_bandits.sw_ucb_tps.reward_scale must be a finite number > 0, got 0"),
    (["experiment=head_bench", "experiment.batches=4"], "experiment.batches must be a list, got 4"),
    (["experiment=bandit_sim", "experiment.scenarios.paper.means=[0.5,1.5]"],
     "experiment.scenarios.paper.means must be a number in [0, 1] (or lists of them), got [0.5, 1.5]"),
    (["experiment=head_decode", "experiment.variants.svd_d8.head.rank=2.5"],
     "experiment.variants.svd_d8.head.rank must be an integer >= 1 or a string or null, got 2.5"),
    (["target=hf"], "target.source is required (the config says ???); set it on the command "
                    "line, e.g. target.source=..."),
]


@pytest.mark.parametrize("overrides,message", BAD_VALUES, ids=[" ".join(o) for o, _ in BAD_VALUES])
def test_a_mistyped_value_is_refused_at_composition(overrides, message):
    with pytest.raises(FlashSpecError) as err:
        validate(composed(*overrides), overrides)
    assert str(err.value) == message


# Leaves no runner reads as a typed value: Hydra's and the logger's settings, the resume mode
# (validate checks it), arms (harness.config_arms parses them), interpolated head choices, and
# the simulation-only oracle's true means.
UNTYPED = ["_target_", "_partial_", "resume", "output_dir", "logger.*", "drafters.arms.*.*",
           "drafters.drafters.*.head", "bandit.means", "experiment.policies.*.means"]


def _matches(pattern: str, key: str) -> bool:
    p, k = pattern.split("."), key.split(".")
    return len(p) == len(k) and all(a in ("*", b) for a, b in zip(p, k))


def _leaves(node, prefix: str = ""):
    """Dotted keys of the scalars of ``node`` (list items by index; empty groups hold none)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1]


@pytest.mark.parametrize("choice", [f"{g}={p.stem}" for g in ("experiment", "drafters", "bandit",
                                    "head", "hardware", "runtime", "dataset", "planner",
                                    "target")
                                    for p in sorted((CONF / g).glob("*.yaml"))])
def test_every_config_value_is_declared_in_the_schema(choice):
    """A key added to conf/ without a type here would be read unchecked: each leaf of every
    option is declared (itself, or a list or mapping above it) or listed as UNTYPED."""
    from omegaconf import OmegaConf
    from experiments.schema import schema
    cfg = OmegaConf.to_container(composed(choice), resolve=False)
    patterns = [*schema(cfg), *(f"*.{u}" if u.startswith("_") else u for u in UNTYPED)]
    undeclared = []
    for key in _leaves(cfg):
        parts = key.split(".")
        prefixes = [".".join(parts[:n]) for n in range(len(parts), 0, -1)]
        if not any(_matches(p, k) or (p.startswith("*.") and k.endswith(p[1:]))
                   for p in patterns for k in prefixes):
            undeclared.append(key)
    assert not undeclared, f"{choice}: add to experiments/schema.py: {undeclared}"


def test_sampling_rules_are_checked_at_composition_naming_the_key():
    """Typed right but outside the sampler's own rule (T = 0 or >= T_MIN): still before loading."""
    with pytest.raises(FlashSpecError, match=r"^experiment\.temperature must be 0 \(greedy\)"):
        validate(composed("experiment.temperature=1e-9"))


@pytest.mark.parametrize("overrides", [["experiment.top_k=2.0"], ["experiment.temperature=1"],
                                       ["dataset.n_prompts=null"], ["drafters.arms=[[ngram,3.0]]"],
                                       ["drafters.arms=[[ngram,4x2x1],[ar,0]]"]])
def test_values_that_read_exactly_pass(overrides):
    validate(composed(*overrides), overrides)


def test_an_integral_float_is_stored_as_the_int():
    """`experiment.top_k=2.0` runs as 2 and the stored config (and so the records) say 2."""
    cfg = composed("dataset.n_prompts=3.0", "experiment=kernel_bench",
                   "experiment.batches=[1.0,8]")
    validate(cfg)
    assert type(cfg.dataset.n_prompts) is int and cfg.dataset.n_prompts == 3
    assert [type(b) for b in cfg.experiment.batches] == [int, int]
    cfg = composed("experiment.top_k=2.0")
    validate(cfg)
    assert type(cfg.experiment.top_k) is int and cfg.experiment.top_k == 2


def test_the_schema_checks_plain_mappings_and_skips_absent_keys():
    check_config({"seed": 0, "experiment": {"name": "decode", "top_k": 3}})   # no dataset etc.
    check_config({"experiment": {"name": "unknown_runner", "top_k": "x"}})     # no schema: no check
    with pytest.raises(FlashSpecError, match=r"^experiment\.top_k must be .*, got 2\.5$"):
        check_config({"experiment": {"name": "decode", "top_k": 2.5}})


@pytest.mark.parametrize("override,message", [
    ("experiment.top_k=2.5", "error: experiment.top_k must be an integer >= 0, got 2.5"),
    ("experiment.temperature=abc", "error: experiment.temperature must be a finite number >= 0, got 'abc'"),
])
def test_run_py_refuses_before_any_model_loads(override, message, tmp_path):
    """End to end: exit 2, the one line last. The target is a file that does not exist: had the
    model been loaded first, the error would name it instead."""
    env = {**os.environ, "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "0"}
    res = subprocess.run([sys.executable, "run.py", "logger=disabled", override,
                          f"target.source={tmp_path / 'no_such_model.gguf'}",
                          f"hydra.run.dir={tmp_path / 'run'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == message
    assert "no_such_model" not in res.stderr and "Traceback" not in res.stderr
    assert not any((tmp_path / "run").glob("*.jsonl"))


# ----------------------------------------------------------------------- records, read defensively
DECODE_REC = {"experiment": "decode", "method": "ar", "dataset": "humaneval", "turn": 0}
BAD_LINES = {
    "not_utf8": (b"\xff\xfe{\"method\": \"ar\"}\n", "not UTF-8 text"),
    "not_json": (b"tokens: [1, 2]\n", "not a JSON record"),
    "json_list": (b"[1, 2, 3]\n", "JSON list, not a record"),
}


def _records_file(path: Path, bad: bytes) -> Path:
    path.write_bytes(b"".join([json.dumps({**DECODE_REC, "prompt_id": "a"}).encode() + b"\n", bad,
                               json.dumps({**DECODE_REC, "prompt_id": "b"}).encode() + b"\n"]))
    return path


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_a_line_that_is_no_record_is_skipped_then_quarantined(case, tmp_path, caplog):
    bad, why = BAD_LINES[case]
    path = _records_file(tmp_path / "records.jsonl", bad)
    with caplog.at_level(logging.WARNING, logger="flashspec"):
        assert [r["prompt_id"] for r in read_records(path)] == ["a", "b"]      # collect's read
    assert f"{path} line 2: {why}" in caplog.text and "skipped" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flashspec"):
        writer = RecordWriter(path)                                            # a resumed run
        assert writer.done_keys("method", "prompt_id", "turn") == {("ar", "a", 0), ("ar", "b", 0)}
    assert f"{path} line 2: {why}" in caplog.text and "moved to records.jsonl.torn" in caplog.text
    assert (tmp_path / "records.jsonl.torn").read_bytes() == bad
    assert len(path.read_bytes().splitlines()) == 2                           # the two records
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flashspec"):
        assert len(list(read_records(path))) == 2
    assert not caplog.text                                                     # quarantined once


def test_a_record_without_its_fields_is_skipped_and_redone(tmp_path, caplog):
    """A decode record without ``method`` would pool into a nameless row (collect) or count as
    done for no method (resume)."""
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps({**DECODE_REC, "prompt_id": "a"}) + "\n"
                    + json.dumps({"experiment": "decode", "dataset": "humaneval", "prompt_id": "b",
                                  "turn": 0}) + "\n" + json.dumps({"prompt_id": "c"}) + "\n")
    with caplog.at_level(logging.WARNING, logger="flashspec"):
        assert [r["prompt_id"] for r in read_records(path)] == ["a", "c"]    # c: no experiment
        assert [r["prompt_id"] for r in read_records(path, experiment="decode")] == ["a"]
        keys = RecordWriter(path).done_keys("method", "prompt_id", "turn")
    assert keys == {("ar", "a", 0)}
    assert f"{path} line 2: record without method; skipped" in caplog.text
    assert f"{path} line 3: record without method, dataset, turn; skipped" in caplog.text


def test_collect_reads_through_the_same_reader(tmp_path, caplog):
    collect = _script("collect")
    job = tmp_path / "job"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "config.yaml").write_text("experiment:\n  name: decode\n")
    rec = {**DECODE_REC, "prompt_id": "a", "tps": 10.0, "decode_tps": 11.0, "n_accepted": 0,
           "n_proposed": 0, "steps": 4, "tau": 1.0, "temperature": 0.0, "batch_size": 1}
    (job / "records.jsonl").write_bytes(
        json.dumps(rec).encode() + b"\n" + BAD_LINES["not_utf8"][0]
        + json.dumps({k: v for k, v in rec.items() if k not in ("method", "experiment")}).encode()
        + b"\n")
    (job / "run_config_history.jsonl").write_text('{"config": {}, "changed": ["seed"]}\n')
    with caplog.at_level(logging.WARNING, logger="flashspec"):
        tables = collect.collect([tmp_path])
    assert tables["decode"]["method"].tolist() == ["ar"]
    assert "run_config_history" not in caplog.text                           # no records in it
    assert "line 2: not UTF-8 text" in caplog.text and "line 3: record without method" in caplog.text
    assert (job / "records.jsonl").read_bytes().count(b"\xff") == 1          # a reader moves nothing
    (job / "job_metrics.json").write_bytes(b"\xff\xfe")
    with pytest.raises(FlashSpecError, match="job_metrics.json is not JSON"):
        collect.collect([tmp_path])
    (job / "job_metrics.json").write_text("[1]")
    with pytest.raises(FlashSpecError, match="job_metrics.json holds JSON list"):
        collect.collect([tmp_path])
    (job / "job_metrics.json").unlink()
    (job / ".hydra" / "config.yaml").write_bytes(b"experiment: {name: \xff}\n")
    with pytest.raises(FlashSpecError, match=r"config\.yaml is unreadable"):
        collect.collect([tmp_path])


# ----------------------------------------------------------------------- resume: prompt data
CFG = {"seed": 0, "experiment": {"name": "decode", "temperature": 0.0}}


def test_resume_compares_the_prompt_data_hash(tmp_path):
    old, new = "a" * 64, "b" * 64
    assert check_resume(tmp_path, CFG, data_hash=old).status == "new"
    assert check_resume(tmp_path, CFG, data_hash=old).status == "same"
    with pytest.raises(FlashSpecError, match=r"other prompt data \(data hash a{12} then, b{12} "
                                             r"now: a prompt file changed\).*'accept'") as err:
        check_resume(tmp_path, CFG, data_hash=new)
    assert "\n" not in str(err.value)
    info = check_resume(tmp_path, CFG, mode="accept", data_hash=new)
    assert info.status == "accepted" and info.changed == ["data_hash"]
    history = json.loads((tmp_path / "run_config_history.jsonl").read_text())
    assert history["data_hash"] == old
    assert check_resume(tmp_path, CFG, data_hash=new).status == "same"


def test_a_run_dir_stored_without_a_data_hash_adopts_one(tmp_path):
    check_resume(tmp_path, CFG)                                   # written before data was compared
    assert check_resume(tmp_path, CFG, data_hash="a" * 64).status == "same"
    with pytest.raises(FlashSpecError, match="data hash"):
        check_resume(tmp_path, CFG, data_hash="b" * 64)


@pytest.fixture()
def prompt_cache(tmp_path, monkeypatch) -> Path:
    """A private prompt cache holding HumanEval, written by the real prepare script."""
    monkeypatch.setenv("FLASHSPEC_DATA", str(tmp_path / "data"))
    _script("prepare_data").prepare(tmp_path / "data", ("humaneval",))
    return tmp_path / "data"


def _edit_prompt_file(folder: Path) -> None:
    """Change the first prompt and update the manifest too (so loading does not refuse it)."""
    from flashspec.data import file_sha256
    path = folder / "humaneval.jsonl"
    lines = path.read_text().splitlines()
    row = json.loads(lines[0])
    row["prompt"] += "# edited\n"
    path.write_text("\n".join([json.dumps(row), *lines[1:]]) + "\n")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["humaneval"]["sha256"] = file_sha256(path)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_changed_prompt_file_is_refused_and_accept_says_what_it_keeps(prompt_cache, tmp_path,
                                                                       caplog):
    out = str(tmp_path / "run")
    with run_dir(composed("logger=disabled", output_dir=out), "records.jsonl",
                 data="humaneval") as run:
        run.write({**DECODE_REC, "prompt_id": "humaneval/1"})
    _edit_prompt_file(prompt_cache)
    with pytest.raises(FlashSpecError, match="other prompt data"):
        with run_dir(composed("logger=disabled", output_dir=out), "records.jsonl", data="humaneval"):
            pass
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flashspec"):
        with run_dir(composed("logger=disabled", "resume=accept", "experiment.temperature=1.0",
                              output_dir=out), "records.jsonl", data="humaneval") as run:
            keys = run.done_keys("method", "prompt_id", "turn")
    assert keys == {("ar", "humaneval/1", 0)}
    kept = [r.getMessage() for r in caplog.records if r.getMessage().startswith("keeping")]
    assert len(kept) == 1 and "\n" not in kept[0]
    assert kept[0].startswith("keeping 1 record(s) already in records.jsonl, written under "
                              "experiment.temperature=0.0 (now 1.0); prompt data ")
    assert "not decoded again" in kept[0]


# ----------------------------------------------------------------------- head files
def _head(tmp_path: Path, **bad) -> Path:
    from flashspec.heads import LowRankHead, save_head
    g = torch.Generator().manual_seed(0)
    w_down, w_up = torch.randn(4, 16, generator=g), torch.randn(50, 4, generator=g)
    for name, value in bad.items():
        {"w_down": w_down, "w_up": w_up}[name][1, 2] = value
    return save_head(LowRankHead(w_down, w_up), tmp_path / "head.safetensors")


@pytest.mark.parametrize("tensor,value", [("w_up", float("nan")), ("w_down", float("inf")),
                                          ("w_up", float("-inf"))])
def test_a_head_file_with_non_finite_weights_names_file_and_tensor(tensor, value, tmp_path):
    from flashspec.heads import load_head
    path = _head(tmp_path, **{tensor: value})
    with pytest.raises(FlashSpecError) as err:
        load_head(path)
    assert str(err.value).startswith(f"head file {path} has NaN or inf weights in {tensor} ")
    assert "\n" not in str(err.value)
    load_head(_head(tmp_path))                                   # a finite one loads


def test_a_damaged_head_file_is_one_line_naming_it(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file
    from flashspec.heads import load_head
    path = _head(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 64])
    with pytest.raises(FlashSpecError, match=f"head file {path} is truncated, corrupt"):
        load_head(path)
    path = _head(tmp_path)
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file({"w_down": tensors["w_down"]}, str(path), metadata=meta)
    with pytest.raises(FlashSpecError, match=f"head file {path} .*lacks the tensor.*w_up"):
        load_head(path)
