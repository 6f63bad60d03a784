"""The decode record schema (flashspec.records.DecodeRecord): the one definition the writer,
read_records, collect and the notebooks share."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from flashspec.errors import FlashSpecError
from flashspec.records import RECORD_FIELDS, DecodeRecord, read_records

ROOT = Path(__file__).resolve().parents[1]
# records a decode job wrote through run.py before the schema became a class (experiment=bench)
WRITTEN = ROOT / "experiments/results/bench_h200_s6151/greedy_he/records.jsonl.gz"


def _fields(**over):
    base = dict(method="spec:ngram@3", dataset="humaneval", prompt_id="humaneval/1", domain="code",
                category="code", turn=0, n_prompt_tokens=10, n_new_tokens=3, wall_s=0.5,
                decode_s=0.4, tps=6.0, decode_tps=7.5, steps=2, n_proposed=3, n_accepted=1,
                alpha=1 / 3, tau=1.5, accept_hist=[1, 1, 0, 0], arms=[0, 0], rewards=[0.0, 1 / 3],
                step_p50_s=0.2, step_p99_s=0.2, capture_s=0.0, gamma=3, batch_size=1,
                batch_id="spec:ngram@3:0:0", temperature=0.0, tokens=[5, 6, 7], text="abc")
    return {**base, **over}


def test_a_written_record_is_the_schema():
    """A record decode wrote carries exactly the schema's fields (and its provenance), and the
    schema rebuilds it: the writer, the class and the reader agree."""
    rec = next(iter(read_records(WRITTEN)))
    optional = {"head_s", "head_calls"}
    assert set(rec) - {"provenance"} == set(DecodeRecord.columns()) - optional
    rebuilt = DecodeRecord(**{k: v for k, v in rec.items() if k != "provenance"}).as_dict()
    assert rebuilt == {k: v for k, v in rec.items() if k != "provenance"}
    assert RECORD_FIELDS["decode"] == DecodeRecord.IDENTITY


def test_the_schema_refuses_broken_records():
    DecodeRecord(**_fields())
    with pytest.raises(FlashSpecError, match="method is None"):
        DecodeRecord(**_fields(method=None))
    with pytest.raises(FlashSpecError, match="accepted"):
        DecodeRecord(**_fields(n_accepted=4))
    with pytest.raises(FlashSpecError, match="tokens"):
        DecodeRecord(**_fields(n_new_tokens=2))
    with pytest.raises(TypeError):
        DecodeRecord(**_fields(), no_such_field=1)
    assert "head_s" not in DecodeRecord(**_fields()).as_dict()
    assert DecodeRecord(**_fields(head_s=0.1, head_calls=2)).as_dict()["head_calls"] == 2


def test_collect_orders_by_the_schema():
    spec = importlib.util.spec_from_file_location("collect", ROOT / "scripts" / "collect.py")
    collect = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(collect)
    assert collect.DECODE_COLUMNS == [*DecodeRecord.columns(), "provenance"]


def test_the_writer_builds_the_schema():
    """experiments/decode.py's record builder goes through the class: what it returns has the
    schema's fields, in its order (a field it forgot or renamed fails here)."""
    from experiments.decode import _record
    from flashspec.core import SamplingParams
    from flashspec.data import Prompt
    st = {"tokens": [5, 6, 7], "steps": 2, "wall_s": 0.5, "decode_s": 0.4, "n_proposed": 3,
          "n_accepted": 1, "accept_hist": [1, 1, 0, 0], "arms": [0, 0], "rewards": [0.0, 0.5],
          "step_p50_s": 0.2, "step_p99_s": 0.2}
    p = Prompt(id="humaneval/1", dataset="humaneval", domain="code", category="code", turns=["x"])
    rec = _record("spec:ngram@3", p, 0, [1, 2], st, "abc", 0, 1, SamplingParams(0.0, 0, 1.0))
    assert list(rec) == [c for c in DecodeRecord.columns() if c not in ("head_s", "head_calls")]
    assert rec["gamma"] == 3 and rec["batch_id"] == "spec:ngram@3:0:0" and rec["alpha"] == 1 / 3
