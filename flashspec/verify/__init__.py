"""Exact speculative verification: one API, several backends (``torch`` reference, ``triton``).

Backends are looked up in :mod:`flashspec.verify.backends` (``get_backend(name, options)``)
and described by :class:`flashspec.verify.api.Backend`. The entries here check their inputs
first (:mod:`flashspec.verify.checks`: shapes, dtypes, token ranges, temperatures, finite
logits; on CUDA tensors that reads the device, a host synchronisation); a backend's own
``verify`` / ``verify_tree`` takes them unchecked, for loops that build valid inputs.
"""
from __future__ import annotations

import torch

# SamplingParams is re-exported here: `from flashspec.verify import SamplingParams` is the README's
# import path (its one definition is flashspec.core's)
from flashspec.core import SamplingParams, TreeDraft
from flashspec.options import KernelOptions
from flashspec.verify.api import Backend, VerifyFn
from flashspec.verify.backends import backend_names, get_backend, register_backend
from flashspec.verify.checks import check_verify, check_verify_tree
from flashspec.verify.sampling import sample, warp_logprobs


def verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
           draft_logits: torch.Tensor | None, params: SamplingParams, seed: int | torch.Tensor = 0,
           backend: str | Backend = "torch", temperature: torch.Tensor | None = None,
           options: KernelOptions | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify drafts against the target: (out_tokens [B, γ+1] padded with -1, n_accepted [B]).
    Raises on bad input (:func:`flashspec.verify.checks.check_verify`) before any backend runs."""
    check_verify(target_logits, draft_tokens, draft_logits, params, seed, temperature)
    return get_backend(backend, options).verify(target_logits, draft_tokens, draft_logits,
                                                params, seed, temperature=temperature)


def verify_tree(target_logits: torch.Tensor, draft: TreeDraft, params: SamplingParams,
                seed: int | torch.Tensor = 0, backend: str | Backend = "torch",
                temperature: torch.Tensor | None = None, depth: int | None = None,
                options: KernelOptions | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify draft trees against the target's logits [B, N + 1, V] (node i's next-token
    logits): (out_tokens [B, D + 1] padded with -1, n_accepted [B], path [B, D]) as
    :func:`flashspec.verify.tree.verify_tree`. Raises on bad input
    (:func:`flashspec.verify.checks.check_verify_tree`) before any backend runs."""
    check_verify_tree(target_logits, draft, params, seed, temperature, depth)
    impl = get_backend(backend, options)
    if impl.verify_tree is None:
        raise ValueError(f"verify backend {impl.name!r} cannot verify trees")
    return impl.verify_tree(target_logits, draft, params, seed, temperature=temperature,
                            depth=depth)


__all__ = ["Backend", "SamplingParams", "VerifyFn", "backend_names", "get_backend",
           "register_backend", "sample", "verify", "verify_tree", "warp_logprobs"]
