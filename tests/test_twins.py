"""Twin drafters and resumable training on the dummy SmolLM2 shape (random weights, CPU,
seconds): resume equals straight training bit for bit; twins share data and settings and differ
only in their head; a twin of another group is refused; the ρ_τ reference decodes with the twin."""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from flashspec.errors import FlashSpecError
from flashspec.heads import LowRankChoice
from flashspec.models import load_model
from flashspec.training.data import DataSpec, DistillData
from flashspec.training.run import JobOptions, run_twins
from flashspec.training.train import Resumable, TrainConfig, train
from flashspec.training.twins import check_twins, head_tag, read_twin

SOURCE = "dummy:smollm2-135m"
TINY = TrainConfig(steps=6, batch_tokens=48, max_len=16, warmup=1, eval_every=2, eval_prompts=0,
                   val_fraction=0.25, log_every=1, unroll=2, noise=0.05, out_norm=True,
                   in_norm=True)


@pytest.fixture(scope="module")
def dummy():
    torch.set_num_threads(1)
    return load_model(SOURCE)


def tiny_data(target, n_seq: int = 8, k: int = 4) -> DistillData:
    """Random sequences in the target's vocabulary with random features and top-k log-probs."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(6, 14, (n_seq,), generator=gen)
    n, d = int(lengths.sum()), target.shape.hidden_size
    logp = torch.log_softmax(torch.randn(n, k + 2, generator=gen), -1)[:, :k]
    meta = {"key": "tiny", "target": "dummy", "sequences": [
        {"prompt_id": f"p{i}"} for i in range(n_seq)]}
    return DistillData(torch.randint(0, 1000, (n,), generator=gen),
                       torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
                       torch.full((n_seq,), 3), torch.randn(n, d, generator=gen).half(),
                       torch.randint(0, 1000, (n, k), generator=gen, dtype=torch.int32),
                       logp.sort(-1, descending=True).values, meta)


@pytest.fixture(scope="module")
def svd_head(dummy):
    target, _ = dummy
    return LowRankChoice(rank=8, init="svd").build(target.lm_head_weight).float()


def test_resume_equals_straight_training(dummy, svd_head, tmp_path):
    """3 steps, pause (state saved), resume, 3 more = 6 straight: same drafter, head, history;
    an epoch boundary, the noise stream and evaluations fall inside the run."""
    target, _ = dummy
    data = tiny_data(target)
    lowrank = lambda _: copy.deepcopy(svd_head).requires_grad_(True)   # the same start each time
    straight = train(target, data, TINY, lowrank(target), progress=False)
    state = tmp_path / "train_state.pt"
    first = train(target, data, TINY, lowrank(target), progress=False,
                  resumable=Resumable(state, call_steps=3, fingerprint="x"))
    assert first.paused and first.steps == 3 and state.is_file()
    second = train(target, data, TINY, lowrank(target), progress=False,
                   resumable=Resumable(state, fingerprint="x"))
    assert not second.paused and second.steps == TINY.steps
    for a, b in [(straight.module, second.module), (straight.head, second.head)]:
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    drop = lambda h: [{k: v for k, v in r.items() if k != "train_s"} for r in h]
    assert drop(straight.history) == drop(second.history)
    with pytest.raises(FlashSpecError, match="other data or settings"):
        train(target, data, dataclasses.replace(TINY, lr=2e-3), lowrank(target), progress=False,
              resumable=Resumable(state, fingerprint="x"))


def job(tmp_path: Path, **kw) -> JobOptions:
    data = DataSpec(datasets={"humaneval": 1, "gsm8k": 1}, samples={"humaneval": 1, "gsm8k": 1},
                    max_new_tokens=6, batch_size=4)
    cfg = dataclasses.replace(TINY, val_fraction=0.0, max_len=160, batch_tokens=320)  # > prompts
    return JobOptions(data=[data], train=cfg,
                      out_dir=tmp_path / "twins", cache_dir=tmp_path / "cache", source=SOURCE,
                      progress=False, **kw)


def test_twins_share_data_and_settings_and_differ_in_head(dummy, tmp_path):
    """full + d/64 twins from one data cache: same twin key, data key, training settings and
    steps; the low-rank twin holds its trained head, the full one none. A twin of another
    seed (another group) is refused as the ρ_τ reference."""
    target, tok = dummy
    res = run_twins(target, tok, job(tmp_path, export=str(tmp_path / "ex_{head}.safetensors")),
                    ["full", "d/64"])
    assert res["finished"] and list(res["heads"]) == ["full", "r9"]
    full, low = (read_twin(tmp_path / f"ex_{t}.safetensors") for t in ("full", "r9"))
    assert full["key"] == low["key"] and full["head"] == "full" and low["head"] == "r9"
    assert full["checkpoint_head"] is None and low["checkpoint_head"] == {"kind": "lowrank", "rank": 9}
    metas = [json.loads((tmp_path / f"ex_{t}.json").read_text())["provenance"]
             for t in ("full", "r9")]
    assert metas[0]["data"] == metas[1]["data"] and metas[0]["train"] == metas[1]["train"]
    assert check_twins(str(tmp_path / "ex_r9.safetensors"),
                       str(tmp_path / "ex_full.safetensors"))["key"] == low["key"]
    with pytest.raises(FlashSpecError, match="not the full-head one"):
        check_twins(str(tmp_path / "ex_full.safetensors"), str(tmp_path / "ex_r9.safetensors"))

    other = job(tmp_path / "b", export=str(tmp_path / "b_{head}.safetensors"))
    other = dataclasses.replace(other, train=dataclasses.replace(other.train, seed=1),
                                cache_dir=tmp_path / "cache")   # the same data, another seed
    run_twins(target, tok, other, ["full"])
    assert read_twin(tmp_path / "b_full.safetensors")["key"] != low["key"]
    with pytest.raises(FlashSpecError, match="not trained the same way"):
        check_twins(str(tmp_path / "ex_r9.safetensors"), str(tmp_path / "b_full.safetensors"))


def test_head_tags_resolve_against_the_targets_d():
    assert [head_tag(h, 576) for h in ("full", "d/8", "d/16", "d/32", 40)] == \
        ["full", "r72", "r36", "r18", "r40"]
    assert [head_tag(h, 1536) for h in ("d/8", "d/16", "d/32")] == ["r192", "r96", "r48"]
