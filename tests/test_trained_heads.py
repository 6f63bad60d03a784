"""Trained low-rank heads of the EAGLE drafter: trained on first use (tiny setup), cached,
keyed by the drafter checkpoint's content; shipped heads found through the drafter's config."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flashspec.drafters.base import DraftContext
from flashspec.drafters.eagle import EagleDrafter
from flashspec.errors import FlashSpecError
from flashspec.heads import LowRankChoice, read_metadata
from flashspec.heads.train import (HeadTrainSpec, cached_head_path, file_sha256, head_key,
                                   target_fingerprint)
from flashspec.models import load_model

ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "checkpoints" / "smollm2_eagle_lr72.safetensors"
TINY = {"n_train": 2, "n_eval": 1, "max_new_tokens": 8, "steps": 3, "batch_size": 8}


@pytest.fixture(scope="module")
def ctx() -> DraftContext:
    torch.set_num_threads(1)
    model, tok = load_model("smollm2")
    return DraftContext(model, tok)


def test_trains_on_first_use_then_hits_the_cache(ctx, tmp_path, caplog):
    choice = LowRankChoice(rank=4)
    with caplog.at_level(logging.INFO, logger="flashspec.heads.train"):
        first = EagleDrafter.build(ctx, "eagle_lr72", str(CKPT), head=choice,
                                   head_cache=str(tmp_path), head_training=TINY)
    assert any("training a rank-4 head for drafter eagle_lr72: about" in r.message
               for r in caplog.records)
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1 and first.head.rank == 4
    meta = read_metadata(files[0])
    assert meta["drafter_sha256"] == file_sha256(CKPT) and meta["rank"] == 4
    assert {"trained", "full_head"} <= set(meta["metrics"])
    assert set(meta["train_prompt_ids"]).isdisjoint(meta["eval_prompt_ids"])
    stamp = files[0].stat().st_mtime_ns

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flashspec.heads.train"):
        second = EagleDrafter.build(ctx, "eagle_lr72", str(CKPT), head=choice,
                                    head_cache=str(tmp_path), head_training=TINY)
    assert not any("training a rank" in r.message for r in caplog.records)
    assert any("cached at" in r.message for r in caplog.records)
    assert files[0].stat().st_mtime_ns == stamp and len(list(tmp_path.glob("*.safetensors"))) == 1
    h = torch.randn(3, ctx.target.shape.hidden_size)
    torch.testing.assert_close(first.head(h), second.head(h))


def test_no_cache_means_no_training(ctx):
    with pytest.raises(FlashSpecError, match="no trained head of that rank"):
        EagleDrafter.build(ctx, "eagle_lr72", str(CKPT), head=LowRankChoice(rank=5),
                           head_cache=None)


def test_cache_key_follows_the_checkpoint_content(ctx, tmp_path):
    copy = tmp_path / "copy.safetensors"
    shutil.copy(CKPT, copy)
    spec = HeadTrainSpec()
    fp = target_fingerprint(ctx.target)
    same = head_key(file_sha256(copy), fp, 36, spec)
    assert same == head_key(file_sha256(CKPT), fp, 36, spec)
    with safe_open(str(CKPT), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["module.fc.bias"] = tensors["module.fc.bias"] + 1e-3
    changed = tmp_path / "changed.safetensors"
    save_file(tensors, str(changed), metadata=meta)
    other = head_key(file_sha256(changed), fp, 36, spec)
    assert other != same
    assert cached_head_path(tmp_path, "x", 36, other) != cached_head_path(tmp_path, "x", 36, same)
    assert head_key(file_sha256(CKPT), fp, 18, spec) != same
    assert head_key(file_sha256(CKPT), fp, 36, HeadTrainSpec(n_train=24)) != same


def test_unknown_training_option_is_refused():
    with pytest.raises(FlashSpecError, match="unknown keys"):
        HeadTrainSpec.from_options({"stpes": 3})


def shipped_heads() -> dict:
    from omegaconf import OmegaConf
    entry = OmegaConf.load(ROOT / "conf" / "drafters" / "default.yaml").drafters.eagle_lr72
    return OmegaConf.to_container(entry.heads)


@pytest.mark.parametrize("rank", ["d/16", "d/32"])
def test_shipped_heads_of_the_default_drafter(ctx, rank):
    """The default drafter's config lists a trained file for d/16 and d/32: no training, no cache."""
    heads = shipped_heads()
    drafter = EagleDrafter.build(ctx, "eagle_lr72", str(CKPT), head=LowRankChoice(rank=rank),
                                 heads=heads, head_cache=None)
    assert drafter.head.rank == ctx.target.shape.hidden_size // int(rank.split("/")[1])
    meta = read_metadata(ROOT / heads[rank])
    assert meta["drafter_sha256"] == file_sha256(CKPT)
    assert meta["metrics"]["trained"]["top1_target"] > meta["metrics"]["asvd_init"]["top1_target"]


def test_a_head_of_another_checkpoint_is_refused(ctx):
    from flashspec.heads.train import load_shipped
    path = ROOT / shipped_heads()["d/32"]
    with pytest.raises(FlashSpecError, match="another 'eagle_lr72' checkpoint"):
        load_shipped(path, 18, "eagle_lr72", "0" * 64)
