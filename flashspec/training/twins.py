"""Twin drafters: one drafter per head choice, trained the same way, so that ρ_τ compares like
with like (SlimSpec: the low-rank-head drafter against the full-head drafter trained with the
same recipe, not against its own backbone fitted with the target's full head).

A twin group shares its ``twin_key``: a hash of what a drafter's training depends on besides its
head (the data: its cache key and its token sequences; the training config; the checkpoint
dtype; the warm-start file's content). Each checkpoint of the group stores the key and its own
head under ``provenance["twin"]``; :func:`check_twins` refuses a pair whose keys differ.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from flashspec.errors import FlashSpecError

TWIN_FORMAT = "flashspec-twin-v1"
FULL = "full"


def head_tag(label: Any, hidden: int) -> str:
    """Directory and file tag of one head choice: ``full`` or ``r<rank>`` with the rank resolved
    against the target's d (``d/8`` is r72 for SmolLM2's d = 576, r192 for Qwen2.5-Coder-1.5B's
    d = 1536)."""
    from flashspec.heads import resolve_rank
    if str(label) == FULL:
        return FULL
    return f"r{resolve_rank(label, hidden)}"


def twin_key(data, train_cfg, save_dtype: str) -> str:
    """The key a twin group shares: data (cache key, target tag and the token sequences
    themselves, so a regenerated cache of other content is another group), every training
    setting (seed and schedule included), the checkpoint dtype and, for ``init:
    checkpoint:<file>``, that file's content. The head is left out: it is what twins differ in."""
    from flashspec.paths import file_sha256, repo_path
    cfg = dataclasses.asdict(train_cfg)
    init = str(cfg.get("init", ""))
    if init.startswith("checkpoint:"):
        cfg["init_sha256"] = file_sha256(repo_path(init.split(":", 1)[1]))
    h = hashlib.sha256(json.dumps({"format": TWIN_FORMAT, "data": data.meta.get("key"),
                                   "target": data.meta.get("target"), "train": cfg,
                                   "save_dtype": save_dtype}, sort_keys=True).encode())
    h.update(data.offsets.numpy().tobytes())
    h.update(data.tokens.numpy().tobytes())
    return h.hexdigest()[:16]


def read_twin(path: str | Path) -> dict[str, Any] | None:
    """``provenance["twin"]`` of a drafter checkpoint ({key, head, heads}), or None."""
    from flashspec.drafters.eagle_checkpoint import read_eagle_metadata
    from flashspec.paths import repo_path
    meta = read_eagle_metadata(repo_path(str(path)))
    twin = (meta.get("provenance") or {}).get("twin")
    return dict(twin, checkpoint_head=meta.get("head")) if isinstance(twin, dict) else None


def check_twins(checkpoint: str, twin: str) -> dict[str, Any]:
    """The twin record of ``twin`` after checking it is the full-head twin of ``checkpoint``:
    both carry a twin key, the keys are equal, and ``twin`` drafts through the full head."""
    mine, theirs = read_twin(checkpoint), read_twin(twin)
    for path, rec in ((checkpoint, mine), (twin, theirs)):
        if rec is None or not rec.get("key"):
            raise FlashSpecError(f"{path} carries no twin key (not trained by experiment="
                                 "train_drafter experiment.heads=[...]); ρ_τ against it would "
                                 "not compare like with like")
    if theirs["head"] != FULL or theirs.get("checkpoint_head"):
        raise FlashSpecError(f"twin {twin} is the {theirs['head']} drafter of its group, not the "
                             "full-head one")
    if mine["key"] != theirs["key"]:
        raise FlashSpecError(f"twin {twin} (twin key {theirs['key']}) was not trained the same way "
                             f"as {checkpoint} (twin key {mine['key']}): other data, settings or "
                             "seed; train both in one experiment.heads=[...] run")
    return theirs
