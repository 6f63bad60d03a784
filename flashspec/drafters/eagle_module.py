"""The EAGLE-style drafter module: fc([feature ; token embedding]) -> decoder blocks -> predicted
feature, and its architecture settings (what a checkpoint stores; the drafter that runs it is
:class:`flashspec.drafters.eagle.EagleDrafter`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.nn.attention import sdpa_kernel

from flashspec.core import TreeAttention
from flashspec.errors import FlashSpecError
from flashspec.models.llama import MASKED_SDPA, Block, KVCache, Linear, LlamaShape, RMSNorm


@dataclass(frozen=True)
class EagleConfig:
    """Architecture of the drafter module (the target supplies d, heads, V and RoPE)."""

    n_layers: int = 1
    out_norm: bool = False      # an RMSNorm on the predicted feature (EAGLE-1 has none)
    in_norm: bool = False       # RMSNorms on the feature and the embedding before fc (EAGLE-3)
    fc_bias: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.n_layers <= 4:
            raise FlashSpecError(f"eagle n_layers={self.n_layers}; use 1 or 2 (at most 4)")


def drafter_shape(target: LlamaShape, n_layers: int) -> LlamaShape:
    """The target's block shape with ``n_layers`` layers (one own KV cache for all of them)."""
    return replace(target, num_layers=n_layers)


class EagleModule(nn.Module):
    """fc([feature ; token embedding]) -> decoder blocks -> predicted feature."""

    def __init__(self, shape: LlamaShape, config: EagleConfig = EagleConfig()) -> None:
        super().__init__()
        self.config = config
        self.shape = drafter_shape(shape, config.n_layers)
        d = shape.hidden_size
        self.fc = Linear(2 * d, d, bias=config.fc_bias)
        self.layers = nn.ModuleList(Block(i, self.shape) for i in range(config.n_layers))
        self.norm = RMSNorm(d, shape.rms_eps) if config.out_norm else None
        self.feat_norm = RMSNorm(d, shape.rms_eps) if config.in_norm else None
        self.embed_norm = RMSNorm(d, shape.rms_eps) if config.in_norm else None

    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Llama-style init: N(0, std) matrices, zero biases, unit norms."""
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=std, generator=generator)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)

    def new_cache(self, batch: int, capacity: int, dtype: torch.dtype, device) -> KVCache:
        return KVCache(list(range(self.config.n_layers)), batch, capacity, self.shape, dtype, device)

    def fuse(self) -> "EagleModule":
        """Merge the blocks' q|k|v and gate|up weights for the fused decode layers."""
        from flashspec.models import fused
        if all(fused.fusable(block) for block in self.layers):
            for block in self.layers:
                fused.fuse_block(block)
        return self

    def forward(self, features: torch.Tensor, embeds: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None, positions: torch.Tensor,
                mask: torch.Tensor | None, cache: KVCache | None = None, span: int | None = None
                ) -> torch.Tensor:
        """Predicted features [B, n, d] for slots with (previous feature, token embedding),
        through the reference blocks (the fused decode layers take prepared inputs:
        :meth:`fused_step`)."""
        features = features.to(embeds.dtype)
        if self.feat_norm is not None:
            features, embeds = self.feat_norm(features), self.embed_norm(embeds)
        return self.reference_step(torch.cat([features, embeds], dim=-1), rope, positions, mask,
                                   cache, span)

    def reference_step(self, inputs: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                       positions: torch.Tensor, mask: torch.Tensor | None,
                       cache: KVCache | None = None, span: int | None = None) -> torch.Tensor:
        """:meth:`fused_step` through the reference blocks (``rope``, ``mask``; ``positions``
        are the cache slots written)."""
        x = self.fc(inputs)
        span = positions.shape[1] if span is None else span
        with sdpa_kernel(MASKED_SDPA):
            for block in self.layers:
                x = block(x, rope, positions, cache, mask, span)
        return self.norm(x) if self.norm is not None else x

    @property
    def input_norms(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """(feature weight, embedding weight, eps) of the input RMSNorms, None without them
        (what :func:`flashspec.models.fused.drafter_input` applies)."""
        if self.feat_norm is None:
            return None
        return self.feat_norm.weight, self.embed_norm.weight, self.feat_norm.eps

    def fused_step(self, inputs: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                   rotary: tuple[torch.Tensor, float], tree: TreeAttention | None = None
                   ) -> torch.Tensor:
        """Predicted features [B, n, d] from the prepared inputs [B, n, 2d] (normed feature ;
        normed embedding, e.g. :func:`flashspec.models.fused.drafter_input`) through the fused
        decode layers: fc, the blocks, the output norm."""
        from flashspec.models.fused import add_rmsnorm, run_blocks
        x, delta = run_blocks(self.layers, self.fc(inputs), positions, cache, *rotary, tree)
        if self.norm is not None:
            return add_rmsnorm(x, delta, self.norm.weight, self.norm.eps)[1]
        return x if delta is None else x + delta


def config_dict(config: EagleConfig) -> dict[str, Any]:
    return asdict(config)
