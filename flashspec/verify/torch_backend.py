"""The ``torch`` backend: the readable references of chain (:mod:`flashspec.verify.reference`)
and tree (:mod:`flashspec.verify.tree`) verification, exact by definition."""
from __future__ import annotations

import torch

from flashspec.options import KernelOptions
from flashspec.verify import reference, tree
from flashspec.verify.api import Backend


def make_backend(options: KernelOptions | None = None) -> Backend:
    """The references as a backend (they have no kernel options). Not graph safe: they raise
    on NaN/inf logits and invalid rows, which reads the device on the host."""
    return Backend("torch", reference.verify, graph_safe=False, graph_safe_warps=False,
                   dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64),
                   verify_tree=tree.verify_tree)
