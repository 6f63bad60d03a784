"""What a verify backend is: its function and the capabilities the engine may rely on.

A backend's ``verify`` has the reference's contract (:func:`flashspec.verify.reference.verify`):
``verify(target_logits [B, γ+1, V], draft_tokens [B, γ], draft_logits [B, γ, V] | None,
params, seed=0, temperature=None) -> (out_tokens [B, γ+1] padded with -1, n_accepted [B])``,
and every backend returns the same tokens for the same inputs and seed. Its ``verify_tree`` has
the tree reference's contract (:func:`flashspec.verify.tree.verify_tree`). Backends are built
by a factory ``make(options: KernelOptions) -> Backend`` and looked up by name in
:mod:`flashspec.verify.backends`. A backend may take its inputs as valid: the public entries
(:func:`flashspec.verify.verify`, :func:`flashspec.verify.verify_tree`) check them first
(:mod:`flashspec.verify.checks`), and the engine builds them valid.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from flashspec.core import SamplingParams

VerifyFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Backend:
    """A verify function and what it can do.

    graph_safe: without top-k/top-p warps, a call never synchronises with the host (invalid
        rows are reported as n_accepted = -1 instead of raised), so it may run inside a
        captured CUDA graph with the target's forward.
    graph_safe_warps: the same holds with top-k/top-p warps set.
    dtypes: logits dtypes it computes natively (others may fall back to the reference).
    verify_tree: draft-tree verification ``(target_logits [B, N+1, V], TreeDraft, params,
        seed, temperature, depth) -> (out [B, D+1], n_accepted [B], path [B, D])``.
    """

    name: str
    verify: VerifyFn
    graph_safe: bool = False
    graph_safe_warps: bool = False
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    verify_tree: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def __call__(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.verify(*args, **kwargs)

    def fuses_in_graph(self, params: SamplingParams) -> bool:
        """Whether verification with ``params`` may be captured in the target's step graph."""
        warped = params.top_k > 0 or params.top_p < 1.0
        return self.graph_safe and (self.graph_safe_warps or not warped)
