"""A decode run killed (SIGKILL) at random points and resumed each time ends with the same
records as an uninterrupted run: same keys, no duplicates, same tokens. At T = 1, so a resumed
run must also restart every random stream where the uninterrupted one had it (a greedy run
would pass with the streams wrong; it has nothing else to check)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["dataset=gsm8k", "dataset.n_prompts=4", "dataset.max_new_tokens=24", "logger=disabled",
        "drafters=ngram", "experiment.methods=[ar,spec]", "experiment.references=[]",
        "experiment.warmup=false"]

pytestmark = pytest.mark.slow


def start(out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"}
    log = open(out.parent / f"{out.name}.stderr", "a")   # a file: a full pipe would block it
    return subprocess.Popen([sys.executable, "run.py", *ARGS, *extra, f"hydra.run.dir={out}"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)


def stderr_of(out: Path) -> str:
    return (out.parent / f"{out.name}.stderr").read_text()[-2000:]


def count(out: Path) -> int:
    path = out / "records.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def records(out: Path) -> list[dict]:
    path = out / "records.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tokens(recs: list[dict]) -> dict[tuple, list[int]]:
    keys = [(r["method"], r["prompt_id"], r["turn"]) for r in recs]
    assert len(keys) == len(set(keys)), "a record was written twice"
    return {k: r["tokens"] for k, r in zip(keys, recs)}


@pytest.mark.parametrize("temperature", ["1.0"])
def test_killed_and_resumed_run_equals_an_uninterrupted_one(tmp_path, temperature):
    extra = [f"experiment.temperature={temperature}"]
    whole = start(tmp_path / "whole", *extra)
    assert whole.wait(timeout=900) == 0, stderr_of(tmp_path / "whole")
    expected = tokens(records(tmp_path / "whole"))
    assert len(expected) == 8

    out, rng, kills = tmp_path / "killed", random.Random(int(float(temperature) * 10)), 0
    total = len(expected)
    for attempt in range(12):
        proc = start(out, *extra)
        # kill after 1-2 more records (then a random 0-0.4 s, often mid-record) for the first
        # two starts; the third runs to the end
        target = count(out) + rng.randint(1, 2) if kills < 2 else total + 1
        while proc.poll() is None and count(out) < target:
            time.sleep(0.02)
        if proc.poll() is None:
            time.sleep(rng.uniform(0.0, 0.4))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
            continue
        assert proc.returncode == 0, stderr_of(out)
        break
    else:
        pytest.fail("the run never finished within 12 resumptions")
    assert kills >= 2, "the run finished before it could be killed twice: lengthen it"
    assert tokens(records(out)) == expected
