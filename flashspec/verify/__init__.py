"""Exact speculative verification: one API, several backends (``torch`` reference, ``triton``)."""
from __future__ import annotations

from typing import Callable

import torch

from flashspec.verify.reference import verify as verify_torch
from flashspec.verify.sampling import SamplingParams, sample, warp_logprobs

VerifyFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def get_backend(name: str) -> VerifyFn:
    """Return the verify function of backend ``name`` ('torch' or 'triton')."""
    if name == "torch":
        return verify_torch
    if name == "triton":
        from flashspec.verify.triton_backend import verify as verify_triton
        return verify_triton
    raise ValueError(f"unknown verify backend {name!r}; choose 'torch' or 'triton'")


def verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
           draft_logits: torch.Tensor | None, params: SamplingParams, seed: int | torch.Tensor = 0,
           backend: str = "torch", temperature: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify drafts against the target: (out_tokens [B, γ+1] padded with -1, n_accepted [B])."""
    return get_backend(backend)(target_logits, draft_tokens, draft_logits, params, seed,
                                temperature=temperature)


__all__ = ["SamplingParams", "get_backend", "sample", "verify", "warp_logprobs"]
