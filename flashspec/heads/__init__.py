"""Drafter LM heads: full, low-rank (SlimSpec) and truncated-vocabulary baselines.

Names are imported lazily so that ``flashspec.analysis.head_bench`` runs on a machine with torch
alone (no safetensors / tqdm / omegaconf).
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "flashspec.heads.modules": ("FullHead", "Head", "LowRankHead", "TruncatedHead", "check_rank",
                                "token_frequencies", "top_ids"),
    "flashspec.heads.build": ("build_head", "resolve_keep", "resolve_rank"),
    "flashspec.heads.distill": ("agreement_metrics", "check_disjoint", "distill_lowrank",
                                "evaluate_head", "kl_rows"),
    "flashspec.heads.io": ("load_frequencies", "load_head", "read_metadata", "save_frequencies",
                           "save_head"),
    "flashspec.theory": ("equal_cost_keep", "equal_cost_rank", "lowrank_cost_ratio"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'flashspec.heads' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


def __dir__() -> list[str]:
    return __all__
