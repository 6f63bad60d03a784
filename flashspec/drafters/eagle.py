"""Feature-level (EAGLE-style) drafter: a small decoder over the target's own hidden states.

Layout ("slot" = token position): slot s reads ``fc([f_{s-1} ; embed(x_s)])`` where f_p is the
target's final-normed hidden state at position p (f_{-1} = 0), runs 1-2 Llama decoder blocks
with their own KV cache, and outputs a predicted feature f̂_s; the LM head (the target's frozen
shared head, or a low-rank head) turns it into the distribution of x_{s+1}. Drafting is
autoregressive on predicted features: slot L-1 (true feature f_{L-2}) gives d_1, slot L reads
(f̂_{L-1}, d_1) and gives d_2, and so on.

Cache sync: every drafting re-reads a fixed window of the last γ + 1 committed tokens, which
rewrites the slots the last step left speculative (rollback is bookkeeping only). The target
features of committed positions come from ``absorb`` (every target step's hidden states, fed by
the stepper) and ``start`` (the prompt's), kept in the drafter's own per-row feature buffer so
no target forward is ever repeated, even when another arm ran the previous steps.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from flashspec.core import SamplingParams, TreeAttention, TreeDraft, TreeShape
from flashspec.drafters.base import DraftContext, Drafter, WindowDrafting, resident_window
from flashspec.drafters.eagle_checkpoint import load_eagle
from flashspec.drafters.eagle_module import EagleModule
from flashspec.errors import FlashSpecError
from flashspec.heads import FullHeadChoice, HeadChoice
from flashspec.models.loading import resolve_dtype
from flashspec.paths import repo_path
from flashspec.tree import grow_tree
from flashspec.models.llama import KVCache, LlamaLM
from flashspec.matmul import linear
from flashspec.verify.sampling import sample


class CastHead(nn.Module):
    """The target's full head kept in another dtype (bf16 on a CPU halves the bytes per call).

    The logits it returns are the ones the drafts are sampled from, so q stays exact.
    """

    kind = "full"

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach().to(dtype), persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return linear(h.to(self.weight.dtype), self.weight)


class EagleDrafter(WindowDrafting, Drafter):
    """Drafts γ tokens per row from the target's features with an :class:`EagleModule`."""

    def __init__(self, target: LlamaLM, module: EagleModule, head: nn.Module | None = None,
                 name: str = "eagle", draft_temperature: float = 1.0) -> None:
        if module.shape.hidden_size != target.shape.hidden_size:
            raise FlashSpecError(f"eagle drafter has d={module.shape.hidden_size}, the target "
                                 f"d={target.shape.hidden_size}; train one for this target")
        if not 0 < draft_temperature < float("inf"):
            raise FlashSpecError(f"draft_temperature must be a positive number, got {draft_temperature}")
        self.target, self.module, self.name = target, module, name
        self.draft_temperature = float(draft_temperature)
        self.head = head if head is not None else target.lm_head
        self.cache: KVCache | None = None
        self.feats: torch.Tensor | None = None   # [B, capacity + 2, d]: f_{p} at column p + 1

    # ------------------------------------------------------------------ state
    def reset(self, batch: int, capacity: int) -> None:
        dev, dt = self.target.device, self.target.dtype
        if self.cache is None or self.cache.k.shape[1] != batch or self.cache.capacity < capacity:
            self.cache = self.module.new_cache(batch, capacity, dt, dev)
            self.feats = torch.zeros(batch, capacity + 2, self.target.shape.hidden_size,
                                     dtype=dt, device=dev)
        self.feats.zero_()

    def start(self, tokens: torch.Tensor, lengths: torch.Tensor, hidden: torch.Tensor) -> None:
        """The prompt's features (positions below lengths - 1) into the feature buffer, then
        the module over the prompt window."""
        dump = self.feats.shape[1] - 1
        cols = torch.arange(hidden.shape[1], device=hidden.device)
        idx = torch.where(cols[None] < (lengths - 1)[:, None], cols[None] + 1, dump)
        self.feats.scatter_(1, idx[..., None].expand(-1, -1, hidden.shape[-1]),
                            hidden.to(self.feats.dtype))
        super().start(tokens, lengths, hidden)

    def _run(self, src: torch.Tensor, cols: torch.Tensor | None, tokens: torch.Tensor,
             positions: torch.Tensor, span: int | None) -> torch.Tensor:
        """Predicted features of a window [B, n] of ``tokens`` at ``positions``: slot t reads
        the feature in column ``cols[b, t]`` of ``src`` [B, P, d] (``cols`` None: column t);
        ``span`` None attends the whole cache. Fused: the inputs are one launch."""
        if self._fusable(src, positions):
            from flashspec.models.fused import drafter_input
            x = drafter_input(src, tokens, self.target.embed_tokens.weight,
                              self.module.input_norms, cols)
            return self.module.fused_step(x, positions, self.cache, self._rotary)
        span = self.cache.capacity if span is None else span
        feats = src if cols is None else src.gather(1, cols[..., None].expand(-1, -1, src.shape[-1]))
        rope = self.target.rope(positions)
        mask = LlamaLM.attention_mask(positions, span, True)
        return self.module(feats, self.target.embed_tokens(tokens), rope, positions, mask,
                           self.cache, span)

    @property
    def _rotary(self) -> tuple[torch.Tensor, float]:
        return self.target.inv_freq, self.target.rope_scale

    def _fusable(self, x: torch.Tensor, positions: torch.Tensor) -> bool:
        """Whether the target's fused decode layers are on and take this module step."""
        if not self.target.fused:
            return False
        from flashspec.models.fused import usable    # triton only once the fused layers are on
        return usable(x, positions, self.cache)

    # ------------------------------------------------------------------ drafting
    tree = True

    def draft_tree(self, tokens: torch.Tensor, lengths: torch.Tensor, shape: TreeShape,
                   params: SamplingParams, seed: torch.Tensor) -> TreeDraft:
        """A draft tree per row (:func:`flashspec.tree.grow_tree`) from the committed ``tokens``
        [B, C] of ``lengths`` [B]: the fixed window of the last depth + 1 committed tokens (as
        ``draft``: a step accepts at most depth drafts, so it covers every slot the last step
        left unfilled) gives the root's predicted feature; each new frontier node runs the
        module once, in drafter cache slot L - 1 + its candidate id, attending the prefix and
        its ancestors (the whole cache: no host-known length). Children are the top draft
        tokens when greedy, else drawn without replacement from q (the drafter's warped
        logits, returned with the tree)."""
        window, positions, root = resident_window(tokens, lengths, shape.max_depth + 1)
        batch, dev = window.shape[0], window.device
        tree_span = self.cache.capacity
        out = self._run(self.feats, positions, window, positions, None)
        rows = torch.arange(batch, device=dev)
        root_feat = out[rows, root]
        base = lengths - 1
        # the nodes expanded last: their predicted features [B, f, d] and node ids [B, f]
        last = [root_feat[:, None], torch.zeros(batch, 1, dtype=torch.long, device=dev)]

        def expand(ids, toks, parents, depth, bits):
            feats, fed = last
            if self._fusable(feats, ids):
                from flashspec.models.fused import drafter_input
                x, pos, slots = drafter_input(feats, toks, self.target.embed_tokens.weight,
                                              self.module.input_norms, parents=(fed, parents),
                                              tree=(base, depth, ids))
                attention = TreeAttention(slots, bits, lengths, tree_span, base)
                new = self.module.fused_step(x, pos, self.cache, self._rotary, tree=attention)
            else:
                col = (fed[:, None, :] == parents[:, :, None]).long().argmax(-1)
                feat = feats.gather(1, col[..., None].expand(-1, -1, feats.shape[-1]))
                pos = (base + depth)[:, None].expand_as(ids)
                attention = TreeAttention(base[:, None] + ids, bits, lengths, tree_span, base)
                new = self.module(feat, self.target.embed_tokens(toks), self.target.rope(pos),
                                  attention.slots, attention.mask, self.cache, tree_span)
            last[:] = [new, ids]
            return self._scaled(self.head(new))

        return grow_tree(self._scaled(self.head(root_feat)), tokens[rows, base], shape, expand,
                         params, None, None if params.greedy else seed)

    def _scaled(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits with ``draft_temperature`` applied (what drafts are drawn from)."""
        return logits if self.draft_temperature == 1.0 else logits / self.draft_temperature

    def _draft(self, tokens: torch.Tensor, positions: torch.Tensor, last_idx: torch.Tensor,
               last_pos: torch.Tensor, gamma: int, params: SamplingParams,
               seed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """γ drafts after the window (see :class:`WindowDrafting`), autoregressive on the
        module's predicted features."""
        out = self._run(self.feats, positions, tokens, positions, None)
        h = out[torch.arange(tokens.shape[0], device=tokens.device), last_idx]
        drafts, draft_logits = [], []
        for i in range(gamma):
            logits = self._scaled(self.head(h))   # q is what was sampled from: still exact
            tok = sample(logits, params, None, seed, i)
            drafts.append(tok)
            draft_logits.append(logits)
            if i + 1 < gamma:
                h = self._run(h[:, None], None, tok[:, None], (last_pos + i)[:, None], None)[:, 0]
        return torch.stack(drafts, 1), torch.stack(draft_logits, 1)

    # ------------------------------------------------------------------ the stepper's calls
    def _catch_up(self, tokens: torch.Tensor, positions: torch.Tensor, span: int | None) -> None:
        self._run(self.feats, positions, tokens, positions, span)

    def absorb(self, hidden: torch.Tensor, lengths: torch.Tensor) -> None:
        """Features f_{L-1+j} of the step go to columns L + j; the columns of rejected drafts
        are rewritten by the next step before any window reads them."""
        cols = lengths[:, None] + torch.arange(hidden.shape[1], device=hidden.device)
        cols = cols.clamp(max=self.feats.shape[1] - 1)
        self.feats.scatter_(1, cols[..., None].expand(-1, -1, hidden.shape[-1]),
                            hidden.to(self.feats.dtype))

    def buffers(self) -> tuple:
        return (self.feats.data_ptr(), self.cache.k.data_ptr())

    # ------------------------------------------------------------------ building
    @classmethod
    def build(cls, ctx: DraftContext, name: str, checkpoint: str,
              head: HeadChoice = FullHeadChoice(), head_dtype: str | None = None,
              heads: Mapping[int | str, str] | None = None,
              head_cache: str | None = ".cache/heads",
              head_training: Mapping[str, Any] | None = None,
              draft_temperature: float = 1.0) -> "EagleDrafter":
        """From a checkpoint of ``experiment=train_drafter``. ``head=lowrank`` at rank r takes
        the drafter's trained head of that rank: the one stored in the checkpoint, else the
        file ``heads[r]`` (rank as int or 'd/N'), else one trained now on the target's
        distribution and cached under ``head_cache`` (``head_training``: data and steps, see
        :class:`flashspec.heads.train.HeadTrainSpec`; ``head_cache: null`` never trains).
        ``head=full`` is the target's own head, kept in ``head_dtype`` when given (a bf16 copy
        halves the bytes per call on a CPU). ``draft_temperature`` divides the drafter's logits
        before sampling (on top of the run's temperature; the verify step is given the divided
        logits, so decoding stays exact): a calibration knob for sampled decoding."""
        from flashspec.heads.train import HeadTrainSpec, trained_heads
        target = ctx.target
        spec = HeadTrainSpec.from_options(head_training)
        module, baked, _ = load_eagle(repo_path(checkpoint), target)
        trained = trained_heads(head, target, ctx.tokenizer, module, name, checkpoint, baked,
                                heads, head_cache, spec)
        chosen = head.build(target.lm_head_weight, trained, name, ctx.kernels.head_triton)
        if chosen is None and head_dtype:
            chosen = CastHead(target.lm_head_weight, resolve_dtype(head_dtype))
        if target.fused:
            module.fuse()
        return cls(target, module, chosen, name=name, draft_temperature=draft_temperature)
