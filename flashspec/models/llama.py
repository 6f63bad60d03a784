"""A compact native Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) with a static KV cache.

Each row of a batch has its own positions; a token at position p is written to cache slot p,
so rolling back is only position bookkeeping (rejected slots are overwritten later and never
attended, because a query at position p only attends slots <= p). Any subset of layers can be
run (layer-skip self-drafting shares the weights and uses its own cache).

Faster layers for few-token cached steps are swapped in at load
(:func:`flashspec.models.fused.fuse_model` sets ``LlamaLM.decode_layers``); this module does not
know them, it only calls the :class:`DecodeLayers` protocol.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashspec.core import TreeAttention
from flashspec.matmul import linear


@dataclass
class LlamaShape:
    """The architecture numbers the native model needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-5
    attention_bias: bool = False
    tie_embeddings: bool = False
    max_positions: int = 8192

    @classmethod
    def from_hf(cls, config) -> "LlamaShape":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        bias = bool(getattr(config, "attention_bias", False) or config.model_type == "qwen2")
        return cls(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   intermediate_size=config.intermediate_size,
                   num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
                   num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                   head_dim=head_dim, rms_eps=config.rms_norm_eps, attention_bias=bias,
                   tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                   max_positions=getattr(config, "max_position_embeddings", 8192))


class KVCache(nn.Module):
    """Static per-layer K/V buffers [B, H_kv, capacity, head_dim] for a set of layer ids."""

    def __init__(self, layer_ids: list[int], batch: int, capacity: int, shape: LlamaShape,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        size = (batch, shape.num_kv_heads, capacity, shape.head_dim)
        self.slot = {layer: i for i, layer in enumerate(layer_ids)}
        self.k = torch.zeros((len(layer_ids), *size), dtype=dtype, device=device)
        self.v = torch.zeros((len(layer_ids), *size), dtype=dtype, device=device)
        self.capacity = capacity

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, span: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B, H, n, D] at slots ``positions`` [B, n]; return the first ``span`` slots."""
        i = self.slot[layer]
        index = positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
        self.k[i].scatter_(2, index, k)
        self.v[i].scatter_(2, index, v)
        return self.k[i, :, :, :span], self.v[i, :, :, :span]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V of slots ``src`` [B, n] to slots ``dst`` [B, n] (all read
        before any is written: a draft tree's accepted path compacted into place)."""
        layers, _, heads, _, dim = self.k.shape
        at = lambda s: s[None, :, None, :, None].expand(layers, -1, heads, -1, dim)
        for buf in (self.k, self.v):
            buf.scatter_(3, at(dst), buf.gather(3, at(src)))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; x [B, H, n, D], cos/sin [B, 1, n, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Linear(nn.Linear):
    """``nn.Linear`` whose few-row CPU products take :func:`flashspec.matmul.linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


# SDPA backends of the reference blocks' masked attention (entered once per forward by
# run_layers and the EAGLE module). cuDNN is left out: it builds a plan per new (queries, keys)
# shape and eager steps change the key span every step, so its host time per call exceeded
# the math path's in a profile of the eager tree step. That step stays launch bound either way.
MASKED_SDPA = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


class Attention(nn.Module):
    def __init__(self, layer_id: int, s: LlamaShape) -> None:
        super().__init__()
        self.layer_id, self.s = layer_id, s
        self.q_proj = Linear(s.hidden_size, s.num_heads * s.head_dim, bias=s.attention_bias)
        self.k_proj = Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=s.attention_bias)
        self.v_proj = Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=s.attention_bias)
        self.o_proj = Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
                cache: KVCache | None, mask: torch.Tensor, span: int) -> torch.Tensor:
        b, n, _ = x.shape
        s = self.s
        q = self.q_proj(x).view(b, n, s.num_heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, s.num_kv_heads, s.head_dim).transpose(1, 2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.write(self.layer_id, k, v, positions, span)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             enable_gqa=s.num_heads != s.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, layer_id: int, s: LlamaShape) -> None:
        super().__init__()
        self.self_attn = Attention(layer_id, s)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_eps)

    def forward(self, x, rope, positions, cache, mask, span) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, positions, cache, mask, span)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecodeLayers(Protocol):
    """Layers that replace the reference blocks on the steps they accept (see
    :class:`flashspec.models.fused.FusedLayers`). The residual stream they return is
    ``residual + delta`` (delta None when there are no blocks)."""

    def usable(self, x: torch.Tensor, positions: torch.Tensor, cache: "KVCache | None") -> bool:
        ...

    def run(self, blocks: Sequence[nn.Module], x: torch.Tensor, positions: torch.Tensor,
            cache: "KVCache", inv_freq: torch.Tensor, rope_scale: float,
            tree: TreeAttention | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        ...

    def final_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, norm: nn.Module
                   ) -> torch.Tensor:
        ...


class LlamaLM(nn.Module):
    """Decoder-only LM. ``forward_hidden`` returns final-normed hidden states; ``logits`` the head."""

    def __init__(self, shape: LlamaShape, inv_freq: torch.Tensor, rope_scale: float = 1.0) -> None:
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(Block(i, shape) for i in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_eps)
        self.lm_head = Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.rope_scale = rope_scale
        # few-token cached steps through these layers where usable (fused.fuse_model sets them)
        self.decode_layers: DecodeLayers | None = None

    @property
    def fused(self) -> bool:
        """Whether decode layers are swapped in (:func:`flashspec.models.fused.fuse_model`)."""
        return self.decode_layers is not None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, batch: int, capacity: int, layers: list[int] | None = None) -> KVCache:
        """A static cache for ``layers`` (default: all) holding ``capacity`` positions per row."""
        ids = list(range(self.shape.num_layers)) if layers is None else list(layers)
        return KVCache(ids, batch, capacity, self.shape, self.dtype, self.device)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return ((emb.cos() * self.rope_scale).to(self.dtype), (emb.sin() * self.rope_scale).to(self.dtype))

    def forward_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                       layers: list[int] | None = None, span: int | None = None,
                       tree: TreeAttention | None = None) -> torch.Tensor:
        """Hidden states [B, n, d] after the final norm, running ``layers`` (default: all).

        ``tree`` (:class:`flashspec.core.TreeAttention`): the tokens are draft-tree nodes
        (:mod:`flashspec.tree`), at RoPE ``positions`` but written to their own slots and
        attending their ancestors and the committed prefix."""
        x = self.embed_tokens(tokens)
        if self._fused_step(x, positions, cache):
            residual, delta = self._fused_layers(x, positions, cache, layers, tree)
            return self.decode_layers.final_norm(residual, delta, self.norm)
        return self.norm(self.run_layers(x, positions, cache, layers, span, tree))

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None,
                   layers: list[int] | None, span: int | None = None,
                   tree: TreeAttention | None = None) -> torch.Tensor:
        """Residual stream after ``layers`` on input embeddings ``x`` (no final norm).

        ``span`` bounds the cache slots attended (host-known max position + 1); None attends the
        whole cache capacity, which needs no device-to-host read. ``tree``: see forward_hidden.
        """
        if self._fused_step(x, positions, cache):
            residual, delta = self._fused_layers(x, positions, cache, layers, tree)
            return residual if delta is None else residual + delta
        if cache is None:
            span = positions.shape[1]
        elif span is None:
            span = cache.capacity
        slots, mask = (tree.slots, tree.mask) if tree is not None else (
            positions, self.attention_mask(positions, span, cache is not None))
        rope = self.rope(positions)
        with sdpa_kernel(MASKED_SDPA):
            for i in (range(self.shape.num_layers) if layers is None else layers):
                x = self.layers[i](x, rope, slots, cache, mask, span)
        return x

    def _fused_step(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None) -> bool:
        return self.decode_layers is not None and self.decode_layers.usable(x, positions, cache)

    def _fused_layers(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                      layers: list[int] | None, tree: TreeAttention | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = range(self.shape.num_layers) if layers is None else layers
        return self.decode_layers.run([self.layers[i] for i in ids], x, positions, cache,
                                      self.inv_freq, self.rope_scale, tree)

    @staticmethod
    def attention_mask(positions: torch.Tensor, span: int, cached: bool) -> torch.Tensor:
        """Bool mask [B, 1, n, span]: a query at position p sees key slots <= p."""
        if cached:
            slots = torch.arange(span, device=positions.device)
            return (slots[None, None, :] <= positions[:, :, None])[:, None]
        return (positions[:, None, :] <= positions[:, :, None])[:, None]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                layers: list[int] | None = None, span: int | None = None) -> torch.Tensor:
        return self.logits(self.forward_hidden(tokens, positions, cache, layers, span))
