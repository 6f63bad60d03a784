"""Weight-only 4-bit NF4 quantisation of the decoder layers through bitsandbytes (CPU or CUDA)."""
from __future__ import annotations

import torch
from torch import nn

from flashspec.errors import FlashSpecError
from flashspec.models.llama import LlamaLM

SCHEMES = ("nf4",)


def _nf4_linear(linear: nn.Linear, compute_dtype: torch.dtype) -> nn.Module:
    import bitsandbytes as bnb
    q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                          quant_type="nf4", compute_dtype=compute_dtype)
    q.weight = bnb.nn.Params4bit(linear.weight.data.float().cpu(), requires_grad=False,
                                 quant_type="nf4")
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    return q.to(linear.weight.device)


def quantize(model: LlamaLM, scheme: str) -> LlamaLM:
    """Replace every nn.Linear inside the decoder layers by an NF4 Linear4bit (head and
    embeddings stay in the model dtype, so drafter heads and verification see full logits)."""
    if scheme not in SCHEMES:
        raise FlashSpecError(f"quantization {scheme!r} is unknown; choose one of {SCHEMES} or null")
    for block in model.layers:
        for parent in (block.self_attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, _nf4_linear(child, model.dtype))
    return model
