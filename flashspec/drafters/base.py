"""The drafter protocol: drafting as device functions over the committed token buffer."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from flashspec.core import SamplingParams, TreeDraft, TreeShape
from flashspec.errors import FlashSpecError
from flashspec.models.llama import LlamaLM
from flashspec.options import DEFAULT, KernelOptions


@dataclass(frozen=True)
class DraftContext:
    """What a drafter builder may use: the target it drafts for, the target's tokenizer, where
    models run (device, dtype name) and the kernel options (``head_triton`` for its head)."""

    target: LlamaLM
    tokenizer: Any = None
    device: str = "cpu"
    dtype: str = "float32"
    kernels: KernelOptions = DEFAULT


class Drafter(ABC):
    """Proposes γ tokens per row from the committed tokens; ``q`` is the exact distribution
    they were sampled from.

    Every method takes and returns device tensors and runs device ops only (no host reads, no
    Python branches on values), so every stepper runs it, the captured one inside CUDA graphs
    (:mod:`flashspec.stepper`). ``tokens`` [B, C] holds each row's prompt and committed tokens,
    ``lengths`` [B] how many.

    - ``draft`` (required): γ drafts per row, their logits (None: one-hot, and the drafter
      sets ``one_hot = True``) and the real drafts per row (None: all γ; a lookup drafter pads
      rows without a continuation, a deterministic proposal, so verification stays exact).
    - ``draft_tree`` (when ``tree``): a draft tree instead of a chain.
    - ``start`` once a batch is prefilled, ``absorb`` the target's hidden states of every step,
      ``catch_up`` over a window the drafter missed: what a drafter with its own state (a KV
      cache, the target's features) keeps up to date with; ``reset`` before a new batch shape;
      ``buffers`` names the device buffers a captured step reads.

    A drafter captures nothing itself: the captured stepper records its calls. Host-side facts
    (:class:`HostFacts`) are a separate, optional protocol. ``build(ctx, name, **options)``
    makes one from a config entry (``_target_: flashspec.drafters.<Class>.build``).
    """

    name: str = "drafter"
    one_hot: bool = False
    tree: bool = False        # whether draft_tree is implemented

    @classmethod
    def build(cls, ctx: DraftContext, name: str, **options: Any) -> "Drafter":
        return cls(name=name, **options)

    @abstractmethod
    def draft(self, tokens: torch.Tensor, lengths: torch.Tensor, gamma: int,
              params: SamplingParams, seed: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(drafts [B, γ], their logits [B, γ, V] or None, real drafts per row [B] or None = γ);
        sampled drafts draw from counter-based streams of ``seed`` (a device scalar)."""

    def draft_tree(self, tokens: torch.Tensor, lengths: torch.Tensor, shape: TreeShape,
                   params: SamplingParams, seed: torch.Tensor) -> TreeDraft:
        """A draft tree of ``shape`` per row (:mod:`flashspec.tree`): children chosen
        deterministically (``TreeDraft.logits`` None) or drawn without replacement from the
        draft logits the tree carries."""
        raise FlashSpecError(f"drafter {self.name!r} cannot draft trees")

    def check_tree(self, shape: TreeShape) -> None:
        """Refuse (:class:`FlashSpecError`) a tree shape this drafter cannot draft."""
        if not self.tree:
            raise FlashSpecError(f"drafter {self.name!r} drafts chains only, not the tree "
                                 f"{shape.label}")

    def reset(self, batch: int, capacity: int) -> None:
        """Prepare for a new batch of ``batch`` rows with room for ``capacity`` positions."""

    def start(self, tokens: torch.Tensor, lengths: torch.Tensor, hidden: torch.Tensor) -> None:
        """After the target's prefill: catch up on the prompts. ``tokens`` [B, w] is the window
        from position 0 (w >= every row's length; padding past it), ``hidden`` [B, h, d] the
        target's hidden states at positions 0 .. h - 1 (valid below ``lengths - 1``)."""

    def absorb(self, hidden: torch.Tensor, lengths: torch.Tensor) -> None:
        """The target's hidden states [B, w, d] of a step fed at positions lengths - 1 + j
        (every step's, also of steps another drafter drafted)."""

    def catch_up(self, tokens: torch.Tensor, lengths: torch.Tensor, width: int) -> None:
        """Run over the last ``width`` committed tokens (their drafter state becomes valid):
        before drafting again after steps that committed tokens outside the drafter's own
        window (plain steps, other arms, a wider γ)."""

    def buffers(self) -> tuple:
        """Identity of the device buffers a captured step reads (data pointers)."""
        return ()


def does(drafter: Drafter, hook: str) -> bool:
    """Whether ``drafter`` has work in an optional hook (``start``, ``catch_up``, ``absorb``):
    its class overrides the base's no-op. A stepper that captures hooks in CUDA graphs skips the
    no-ops (a graph of nothing is an empty capture, which torch warns about)."""
    return getattr(type(drafter), hook) is not getattr(Drafter, hook)


@runtime_checkable
class HostFacts(Protocol):
    """Optional: cheap facts about the next step that a context-conditioned policy may read
    (past only), from the committed tokens on the host (the captured stepper copies its
    device buffer for them once a chunk, only when a policy asks)."""

    def features(self, tokens: Sequence[Sequence[int]], finished: Sequence[bool]
                 ) -> dict[str, object]: ...


def resident_window(tokens: torch.Tensor, lengths: torch.Tensor, width: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, positions [B, width], column of the last committed token [B]) of the fixed
    window over the last ``width`` committed tokens of each row of ``tokens`` [B, C] (from
    position 0 when a row is shorter): one shape for every step, so a graph can replay it."""
    start = (lengths - width).clamp(min=0)
    positions = start[:, None] + torch.arange(width, device=lengths.device)
    return tokens.gather(1, positions), positions, lengths - 1 - start


class WindowDrafting:
    """Mixin of model drafters: drafting re-reads the last γ + 1 committed tokens (a fixed
    window: one shape for every step; the slots it rewrites hold the same values or stale
    speculative ones), then drafts γ tokens.

    The subclass implements ``_draft(tokens, positions, last_idx, last_pos, gamma, params,
    seed)``: a window [B, w] whose column ``last_idx[b]`` is row b's last committed token, then
    γ drafts at positions ``last_pos[b] + i``, attending the whole cache; and ``_catch_up(tokens,
    positions, span)``: run over a window, no drafting (``span`` None: the whole cache).
    """

    def _draft(self, tokens: torch.Tensor, positions: torch.Tensor, last_idx: torch.Tensor,
               last_pos: torch.Tensor, gamma: int, params: SamplingParams,
               seed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _catch_up(self, tokens: torch.Tensor, positions: torch.Tensor, span: int | None) -> None:
        raise NotImplementedError

    def draft(self, tokens: torch.Tensor, lengths: torch.Tensor, gamma: int,
              params: SamplingParams, seed: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        window, positions, last = resident_window(tokens, lengths, gamma + 1)
        drafts, logits = self._draft(window, positions, last, lengths, gamma, params,
                                     None if params.greedy else seed)
        return drafts, None if params.greedy else logits, None   # greedy verify ignores q

    def start(self, tokens: torch.Tensor, lengths: torch.Tensor, hidden: torch.Tensor) -> None:
        width = tokens.shape[1]
        positions = torch.arange(width, device=tokens.device).expand(tokens.shape[0], width)
        self._catch_up(tokens, positions, width)

    def catch_up(self, tokens: torch.Tensor, lengths: torch.Tensor, width: int) -> None:
        self._catch_up(*resident_window(tokens, lengths, width)[:2], None)
