"""Drafters that run a native LM: a separate small model, or a layer subset of the target."""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from flashspec.core import SamplingParams
from flashspec.drafters.base import DraftContext, Drafter, WindowDrafting
from flashspec.errors import FlashSpecError
from flashspec.heads import FullHeadChoice, HeadChoice, load_head
from flashspec.models import load_model
from flashspec.models.llama import KVCache, LlamaLM
from flashspec.models.loading import source_config
from flashspec.paths import repo_path
from flashspec.verify.sampling import sample


class ModelDrafter(WindowDrafting, Drafter):
    """Autoregressive drafting with ``model`` restricted to ``layers`` (None: all of them).

    A layer-skip / early-exit self-drafter passes the target itself with a layer subset: the
    weights are shared, the KV cache is the drafter's own. ``head`` replaces the model's LM head
    (low-rank or truncated heads); the logits it returns are what the draft was sampled from.
    """

    def __init__(self, model: LlamaLM, layers: list[int] | None = None, head: nn.Module | None = None,
                 name: str = "model") -> None:
        self.model, self.layers, self.name = model, layers, name
        self.head = head if head is not None else model.lm_head
        self.cache: KVCache | None = None

    @classmethod
    def layerskip(cls, ctx: DraftContext, name: str, first: int | None = None,
                  skip: Sequence[int] | None = None, layers: Sequence[int] | None = None,
                  head: HeadChoice = FullHeadChoice(),
                  trained_heads: Mapping[int, str] | None = None) -> "ModelDrafter":
        """Self-draft with the target's own layers: ``layers: [..]`` explicit, ``first: k``, or
        ``skip: [lo, hi)``. ``trained_heads`` maps a rank to a distilled head file of this drafter."""
        chosen = layer_set(name, ctx.target.shape.num_layers, first, skip, layers)
        trained = {int(r): load_head(repo_path(p))[0] for r, p in (trained_heads or {}).items()}
        return cls(ctx.target, chosen, head=head.build(ctx.target.lm_head_weight, trained, name,
                                           ctx.kernels.head_triton), name=name)

    @classmethod
    def separate(cls, ctx: DraftContext, name: str, source: str, dtype: str | None = None,
                 quantization: str | None = None, head: HeadChoice = FullHeadChoice()
                 ) -> "ModelDrafter":
        """A separate (small) LM of the target's family: ``source`` as for the target."""
        config = source_config(source)
        vocab = ctx.target.shape.vocab_size
        if config is not None and config.vocab_size != vocab:
            raise FlashSpecError(f"drafter {name!r} has a different vocabulary than the target "
                                 f"({config.vocab_size} vs {vocab} ids); pick a drafter of the "
                                 "same model family")
        model, tok = load_model(source, dtype=dtype or ctx.dtype, device=ctx.device,
                                quantization=quantization)
        if vocab != model.shape.vocab_size or (ctx.tokenizer is not None
                                               and ctx.tokenizer.get_vocab() != tok.get_vocab()):
            raise FlashSpecError(f"drafter {name!r} has a different vocabulary/tokenizer than the "
                                 f"target ({model.shape.vocab_size} vs {vocab} ids); pick a drafter "
                                 "of the same model family")
        if ctx.target.fused and quantization is None:
            # the run asked for fused decode layers (runtime.fused_layers): the draft LM's
            # few-token steps take them too, as the target's and an EAGLE module's do
            from flashspec.models.fused import fuse_model
            fuse_model(model)
        return cls(model, None, head=head.build(model.lm_head_weight, None, name, ctx.kernels.head_triton),
                   name=name)

    def reset(self, batch: int, capacity: int) -> None:
        if self.cache is None or self.cache.k.shape[1] != batch or self.cache.capacity < capacity:
            self.cache = self.model.new_cache(batch, capacity, self.layers)

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, span: int | None,
              last_idx: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of a window (of its column ``last_idx[b]`` per row when given)."""
        hidden = self.model.forward_hidden(tokens, positions, self.cache, self.layers, span)
        if last_idx is not None:
            hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_idx]
        return self.head(hidden)

    def _draft(self, tokens: torch.Tensor, positions: torch.Tensor, last_idx: torch.Tensor,
               last_pos: torch.Tensor, gamma: int, params: SamplingParams,
               seed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """γ drafts after the window (see :class:`WindowDrafting`)."""
        logits = self._step(tokens, positions, None, last_idx)
        drafts, draft_logits = [], []
        for i in range(gamma):
            tok = sample(logits, params, None, seed, i)
            drafts.append(tok)
            draft_logits.append(logits)
            if i + 1 < gamma:
                logits = self._step(tok[:, None], (last_pos + i)[:, None], None)[:, 0]
        return torch.stack(drafts, 1), torch.stack(draft_logits, 1)

    def _catch_up(self, tokens: torch.Tensor, positions: torch.Tensor, span: int | None) -> None:
        self.model.forward_hidden(tokens, positions, self.cache, self.layers, span)

    def buffers(self) -> tuple:
        return (self.cache.k.data_ptr(),)


def layer_set(name: str, n_layers: int, first: int | None = None, skip: Sequence[int] | None = None,
              layers: Sequence[int] | None = None) -> list[int]:
    """Layers of a self-drafter: ``layers`` explicit, the ``first`` k, or all but ``skip`` [lo, hi)."""
    if layers is not None:
        chosen = [int(i) for i in layers]
    elif first is not None:
        chosen = list(range(int(first)))
    elif skip is not None:
        lo, hi = (int(x) for x in skip)
        chosen = [i for i in range(n_layers) if not lo <= i < hi]
    else:
        raise FlashSpecError(f"layerskip drafter {name!r} needs `layers`, `first` or `skip`")
    if not chosen or any(not 0 <= i < n_layers for i in chosen):
        raise FlashSpecError(f"layerskip drafter {name!r}: layers must be a non-empty subset of "
                             f"0..{n_layers - 1}, got {chosen}")
    return chosen
