"""Drafter LM heads: full, low-rank (SlimSpec) and truncated-vocabulary baselines."""
from flashspec.heads.choice import (FullHeadChoice, HeadChoice, LowRankChoice, TruncatedChoice,
                                    resolve_keep, resolve_rank)
from flashspec.heads.distill import (agreement_metrics, check_disjoint, distill_lowrank,
                                     evaluate_head, kl_rows)
from flashspec.heads.io import load_frequencies, load_head, read_metadata, save_frequencies, save_head
from flashspec.heads.modules import (FullHead, Head, LowRankHead, TruncatedHead, check_rank,
                                     token_frequencies, top_ids)
from flashspec.theory import equal_cost_keep, equal_cost_rank, lowrank_cost_ratio

__all__ = ["FullHead", "FullHeadChoice", "Head", "HeadChoice", "LowRankChoice", "LowRankHead",
           "TruncatedChoice", "TruncatedHead", "agreement_metrics", "check_disjoint", "check_rank",
           "distill_lowrank", "equal_cost_keep", "equal_cost_rank", "evaluate_head", "kl_rows",
           "load_frequencies", "load_head", "lowrank_cost_ratio", "read_metadata", "resolve_keep",
           "resolve_rank", "save_frequencies", "save_head", "token_frequencies", "top_ids"]
