"""Exact speculative verification: one API, several backends (``torch`` reference, ``triton``).

Backends are looked up in :mod:`flashspec.verify.backends` (``get_backend(name, options)``)
and described by :class:`flashspec.verify.api.Backend`.
"""
from __future__ import annotations

import torch

from flashspec.options import KernelOptions
from flashspec.verify.api import Backend, VerifyFn
from flashspec.verify.backends import backend_names, get_backend, register_backend
from flashspec.verify.sampling import SamplingParams, sample, warp_logprobs


def verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
           draft_logits: torch.Tensor | None, params: SamplingParams, seed: int | torch.Tensor = 0,
           backend: str | Backend = "torch", temperature: torch.Tensor | None = None,
           options: KernelOptions | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify drafts against the target: (out_tokens [B, γ+1] padded with -1, n_accepted [B])."""
    return get_backend(backend, options).verify(target_logits, draft_tokens, draft_logits,
                                                params, seed, temperature=temperature)


__all__ = ["Backend", "SamplingParams", "VerifyFn", "backend_names", "get_backend",
           "register_backend", "sample", "verify", "warp_logprobs"]
