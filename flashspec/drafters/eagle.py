"""Feature-level (EAGLE-style) drafter: a small decoder over the target's own hidden states.

Layout ("slot" = token position): slot s reads ``fc([f_{s-1} ; embed(x_s)])`` where f_p is the
target's final-normed hidden state at position p (f_{-1} = 0), runs 1-2 Llama decoder blocks
with their own KV cache, and outputs a predicted feature f̂_s; the LM head (the target's frozen
shared head, or a low-rank head) turns it into the distribution of x_{s+1}. Drafting is
autoregressive on predicted features: slot L-1 (true feature f_{L-2}) gives d_1, slot L reads
(f̂_{L-1}, d_1) and gives d_2, and so on.

Cache sync: slots fed with a true feature and a committed token are valid (``filled``); the
speculative slots are overwritten at the next step (rollback is bookkeeping only). The target
features of committed positions come from ``DecodeState.hidden`` (set by the engine after every
target forward), copied into the drafter's own per-row feature buffer so no target forward is
ever repeated, even when another arm ran the previous steps.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from flashspec.core import SamplingParams, TreeAttention, TreeDraft, TreeShape
from flashspec.drafters.base import (DecodeState, DraftContext, Drafter, GraphedDrafting,
                                     resident_window)
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


class EagleDrafter(GraphedDrafting, Drafter):
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
        self.filled: list[int] = []
        self.known: list[int] = []               # features f_0 .. f_{known-1} are stored

    # ------------------------------------------------------------------ state
    def reset(self, batch: int, capacity: int) -> None:
        dev, dt = self.target.device, self.target.dtype
        if self.cache is None or self.cache.k.shape[1] != batch or self.cache.capacity < capacity:
            self.cache = self.module.new_cache(batch, capacity, dt, dev)
            self.feats = torch.zeros(batch, capacity + 2, self.target.shape.hidden_size,
                                     dtype=dt, device=dev)
            if self.graphs is not None:
                self.graphs.clear()
        self.feats.zero_()
        self.filled, self.known = [0] * batch, [0] * batch

    def start(self, state: DecodeState) -> None:
        self._absorb(state)       # the prompt's features, before a plain step replaces them

    def _absorb(self, state: DecodeState) -> None:
        """Copy the committed columns of ``state.hidden`` into the feature buffer (idempotent)."""
        if state.hidden is None or not any(state.hidden_valid):
            return
        hidden, width = state.hidden, state.hidden.shape[1]
        dump = self.feats.shape[1] - 1
        cols = torch.arange(width)
        idx = torch.tensor(state.hidden_start)[:, None] + 1 + cols
        valid = cols[None] < torch.tensor(state.hidden_valid)[:, None]
        idx = torch.where(valid, idx.clamp(max=dump - 1), torch.full_like(idx, dump))
        idx = idx.to(hidden.device)[..., None].expand(-1, -1, hidden.shape[-1])
        self.feats.scatter_(1, idx, hidden.to(self.feats.dtype))
        self.known = [max(k, s + v) if v else k for k, s, v in
                      zip(self.known, state.hidden_start, state.hidden_valid)]

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
    def _window(self, state: DecodeState) -> tuple[list[int], int]:
        """Absorb the last step's features; the catch-up window (starts, width) to run."""
        self._absorb(state)
        lengths = state.lengths
        missing = [b for b, (n, k) in enumerate(zip(lengths, self.known)) if k < n - 1]
        if missing:
            raise FlashSpecError(f"eagle drafter lacks target features for rows {missing}; it "
                                 "must be reset by the engine before the prompt's prefill")
        width = max(1, max(n - f for n, f in zip(lengths, self.filled)))
        return [max(0, n - width) for n in lengths], width

    @torch.inference_mode()
    def propose(self, state: DecodeState, gamma: int, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        starts, width = self._window(state)
        drafts, logits = self._drafts(state, starts, width, gamma, params, generator)
        self.filled = list(state.lengths)  # speculative slots used predicted features: never valid
        return drafts, logits

    tree = True

    @torch.inference_mode()
    def propose_tree(self, state: DecodeState, shape: TreeShape, params: SamplingParams,
                     generator: torch.Generator | None) -> TreeDraft:
        """A draft tree per row (:func:`flashspec.tree.grow_tree`): the catch-up window gives
        the root's predicted feature; each new frontier node runs the module once, in drafter
        cache slot L - 1 + its candidate id, attending the prefix and its ancestors. Children
        are the top draft tokens when greedy, else drawn without replacement from q (the
        drafter's warped logits, returned with the tree for verification)."""
        starts, width = self._window(state)
        tokens, positions = state.window(starts, width)
        lengths = torch.tensor(state.lengths, device=state.device)
        root = lengths - 1 - torch.tensor(starts, device=state.device)
        tree = self._grow(tokens, positions, root, lengths, state.tokens, shape, params,
                          max(state.lengths), generator, None)
        self.filled = list(state.lengths)
        return tree

    def _grow(self, window: torch.Tensor, positions: torch.Tensor, root: torch.Tensor,
              lengths: torch.Tensor, tokens: torch.Tensor, shape: TreeShape,
              params: SamplingParams, span: int | None, generator: torch.Generator | None,
              seed: torch.Tensor | None) -> TreeDraft:
        """The tree drafting of ``propose_tree`` and ``resident_tree``: the catch-up ``window``
        at ``positions`` [B, w] (column ``root[b]``: row b's last committed token) gives the
        root's predicted feature, then :func:`flashspec.tree.grow_tree` over ``lengths``.
        ``span`` None attends the whole cache (no host-known length: what a graph needs)."""
        batch, dev = window.shape[0], window.device
        tree_span = self.cache.capacity if span is None else span + shape.candidates
        out = self._run(self.feats, positions, window, positions, span)
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
                         params, generator, seed)

    def _scaled(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits with ``draft_temperature`` applied (what drafts are drawn from)."""
        return logits if self.draft_temperature == 1.0 else logits / self.draft_temperature

    def _draft(self, tokens: torch.Tensor, positions: torch.Tensor, last_idx: torch.Tensor,
               last_pos: torch.Tensor, gamma: int, params: SamplingParams,
               generator: torch.Generator | None, seed: torch.Tensor | None, span: int | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Device part of ``propose`` (see :class:`GraphedDrafting`)."""
        out = self._run(self.feats, positions, tokens, positions, span)
        h = out[torch.arange(tokens.shape[0], device=tokens.device), last_idx]
        drafts, draft_logits = [], []
        for i in range(gamma):
            logits = self._scaled(self.head(h))   # q is what was sampled from: still exact
            tok = sample(logits, params, generator, seed, i)
            drafts.append(tok)
            draft_logits.append(logits)
            if i + 1 < gamma:
                h = self._run(h[:, None], None, tok[:, None], (last_pos + i)[:, None],
                              None if span is None else span + i + 1)[:, 0]
        return torch.stack(drafts, 1), torch.stack(draft_logits, 1)

    # ------------------------------------------------------------------ resident loop
    def resident_start(self, state: DecodeState, capture: bool = False) -> None:
        self._absorb(state)
        super().resident_start(state, capture)

    def _catch_up(self, tokens: torch.Tensor, positions: torch.Tensor, span: int | None) -> None:
        self._run(self.feats, positions, tokens, positions, span)

    def resident_tree(self, tokens: torch.Tensor, lengths: torch.Tensor, shape: TreeShape,
                      params: SamplingParams, seed: torch.Tensor) -> TreeDraft:
        """A draft tree per row from the committed ``tokens`` [B, C] of ``lengths`` [B]: the
        fixed window of the last depth + 1 committed tokens (as ``resident_draft``: a step
        accepts at most depth drafts, so it covers every slot the last step left unfilled),
        then ``propose_tree``'s growth over the whole cache; device ops only."""
        window, positions, root = resident_window(tokens, lengths, shape.max_depth + 1)
        return self._grow(window, positions, root, lengths, tokens, shape, params, None, None,
                          None if params.greedy else seed)

    def resident_absorb(self, hidden: torch.Tensor, lengths: torch.Tensor) -> None:
        """Features f_{L-1+j} of the step go to columns L + j; the columns of rejected drafts
        are rewritten by the next step before any window reads them."""
        cols = lengths[:, None] + torch.arange(hidden.shape[1], device=hidden.device)
        cols = cols.clamp(max=self.feats.shape[1] - 1)
        self.feats.scatter_(1, cols[..., None].expand(-1, -1, hidden.shape[-1]),
                            hidden.to(self.feats.dtype))

    def resident_buffers(self) -> tuple:
        return (self.feats.data_ptr(), self.cache.k.data_ptr())

    def observe(self, state: DecodeState, n_accepted: list[int]) -> None:
        self._absorb(state)
        self.filled = [min(f, n) for f, n in zip(self.filled, state.lengths)]

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
