"""The drafter interface and the decode state that drafters read."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from flashspec.core import SamplingParams, TreeDraft, TreeShape
from flashspec.errors import FlashSpecError
from flashspec.graphs import GraphCache, bucketed
from flashspec.models.llama import LlamaLM
from flashspec.options import DEFAULT, KernelOptions


@dataclass
class DecodeState:
    """Committed tokens of every row, on device and on host.

    ``tokens[b, :lengths[b]]`` is row b's prompt plus accepted output. The target's KV cache
    holds positions ``0 .. lengths[b] - 2``: the last committed token is fed at the next step.
    """

    tokens: torch.Tensor                  # [B, capacity] int64, padded with 0
    lengths: list[int]                    # committed length per row (host)
    host_tokens: list[list[int]]          # same content as ``tokens`` (host)
    finished: list[bool]
    # Target hidden states (after the final norm) of the last target forward, [B, w, d]:
    # column j of row b is the state at position hidden_start[b] + j; the first
    # hidden_valid[b] columns belong to committed tokens (feature-level drafters read them).
    hidden: torch.Tensor | None = None
    hidden_start: list[int] = field(default_factory=list)
    hidden_valid: list[int] = field(default_factory=list)
    domain: str | None = None

    def set_hidden(self, hidden: torch.Tensor, start: list[int], valid: list[int] | None) -> None:
        self.hidden, self.hidden_start = hidden, start
        self.hidden_valid = valid if valid is not None else [0] * len(start)

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def window(self, starts: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and positions [B, width] from ``starts[b]`` on (beyond a row's length: padding)."""
        pos = torch.tensor(starts, device=self.device)[:, None] + torch.arange(width, device=self.device)
        pos = pos.clamp(max=self.tokens.shape[1] - 1)
        return self.tokens.gather(1, pos), pos


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
    """Proposes γ tokens per row; ``q`` is the exact distribution they were sampled from.

    Everything the engine and the planner use is declared here:

    - ``propose`` returns (tokens [B, γ'], logits [B, γ', V] or None) with γ' <= γ (None: the
      proposal is deterministic, so q is one-hot; such drafters set ``one_hot = True``).
    - ``reset`` before every new batch of prompts; ``observe`` after every commit so the
      drafter can roll its own state back.
    - ``available``: how many drafts each row would really get (the planner asks before
      paying for a proposal); ``features``: cheap facts about the next step that a
      context-conditioned policy may read (past only).
    - ``propose_tree`` (when ``tree``): a draft tree instead of a chain.
    - ``prepare_graphs`` / ``capture_s`` / ``catching_up``: drafting through static buffers
      (CUDA graphs on a GPU), its capture time, and whether the last proposal ran a long eager
      catch-up window (a step whose time says nothing of the width's cost).

    ``build(ctx, name, **options)`` makes one from a config entry (``_target_:
    flashspec.drafters.<Class>.build``); subclasses that need the target override it.
    """

    name: str = "drafter"
    one_hot: bool = False

    @classmethod
    def build(cls, ctx: DraftContext, name: str, **options: Any) -> "Drafter":
        return cls(name=name, **options)

    def reset(self, batch: int, capacity: int) -> None:
        """Prepare for a new batch of ``batch`` rows with room for ``capacity`` positions."""

    @abstractmethod
    def propose(self, state: DecodeState, gamma: int, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts [B, γ'] and the logits they were sampled from (None when one-hot)."""

    def start(self, state: DecodeState) -> None:
        """After the target's prefill of ``state`` (the reference loop): keep what the drafter
        needs of the prompt before any step replaces ``state.hidden`` (the first step may be
        another arm's)."""

    def observe(self, state: DecodeState, n_accepted: list[int]) -> None:
        """Rows advanced by n_accepted[b] + 1 tokens (already in ``state``)."""

    def available(self, state: DecodeState, gamma: int) -> list[int]:
        """Drafts each row would get at this γ (0 for finished rows)."""
        return [0 if done else gamma for done in state.finished]

    def features(self, state: DecodeState) -> dict[str, object]:
        """Cheap facts about the next step a context-conditioned bandit may read (past only)."""
        return {}

    def prepare_graphs(self, batch: int, gamma: int, params: SamplingParams,
                       device: torch.device, capture: bool) -> None:
        """Set drafting up for static buffers (``capture``: CUDA graphs); default: eager."""

    @property
    def capture_s(self) -> float:
        """Seconds spent capturing drafting graphs so far."""
        return 0.0

    @property
    def catching_up(self) -> bool:
        """Whether the last proposal ran a long eager window (e.g. a new prompt)."""
        return False

    # ------------------------------------------------------------------ draft trees
    tree: bool = False        # whether propose_tree is implemented

    def check_tree(self, shape: TreeShape) -> None:
        """Refuse (:class:`FlashSpecError`) a tree shape this drafter cannot draft."""
        if not self.tree:
            raise FlashSpecError(f"drafter {self.name!r} drafts chains only, not the tree "
                                 f"{shape.label}")

    def propose_tree(self, state: DecodeState, shape: TreeShape, params: SamplingParams,
                     generator: torch.Generator | None) -> TreeDraft:
        """A draft tree of ``shape`` per row (:mod:`flashspec.tree`): children chosen
        deterministically (``TreeDraft.logits`` None) or drawn without replacement from the
        draft logits the tree carries."""
        raise FlashSpecError(f"drafter {self.name!r} cannot draft trees")

    # ------------------------------------------------------------------ resident loop
    # (flashspec.resident): drafting as device ops over the device token buffer, no host state
    resident: bool = False    # whether the methods below are implemented (resident_tree: with tree)

    def resident_start(self, state: DecodeState, capture: bool = False) -> None:
        """After the target's prefill of ``state``: catch up on the prompts (``capture``: the
        resident steps are CUDA graphs, so may this be)."""

    def resident_catch_up(self, tokens: torch.Tensor, lengths: torch.Tensor, width: int,
                          capture: bool = False) -> None:
        """Run over the last ``width`` committed tokens of ``tokens`` [B, C] of ``lengths`` [B]
        (their drafter state becomes valid): before drafting again after steps that committed
        tokens outside the drafter's own window (plain steps, other arms, a wider γ)."""

    def prepare_catch_up(self, tokens: torch.Tensor, lengths: torch.Tensor,
                         widths: Sequence[int], capture: bool = True) -> None:
        """Ready every catch-up window of ``widths`` before a decode (a drafter that replays
        its catch-up from CUDA graphs records the ones it lacks, and runs nothing for the rest)."""
        for width in widths:
            self.resident_catch_up(tokens, lengths, width, capture)

    def resident_draft(self, tokens: torch.Tensor, lengths: torch.Tensor, gamma: int,
                       params: SamplingParams, seed: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(drafts [B, γ], their logits or None, real drafts per row [B] or None = γ) from the
        committed ``tokens`` [B, C] of ``lengths`` [B]; device ops only (graph-safe)."""
        raise FlashSpecError(f"drafter {self.name!r} cannot draft in the resident loop")

    def resident_tree(self, tokens: torch.Tensor, lengths: torch.Tensor, shape: TreeShape,
                      params: SamplingParams, seed: torch.Tensor) -> TreeDraft:
        """A draft tree of ``shape`` per row (as ``propose_tree``) from the committed
        ``tokens`` of ``lengths``; device ops only (when ``tree`` and ``resident``)."""
        raise FlashSpecError(f"drafter {self.name!r} cannot draft trees in the resident loop")

    def resident_absorb(self, hidden: torch.Tensor, lengths: torch.Tensor) -> None:
        """The target's hidden states [B, γ+1, d] of the step fed at positions lengths - 1 + j."""

    def resident_buffers(self) -> tuple:
        """Identity of the device buffers a captured step reads (data pointers)."""
        return ()


def resident_window(tokens: torch.Tensor, lengths: torch.Tensor, width: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, positions [B, width], column of the last committed token [B]) of the fixed
    window over the last ``width`` committed tokens of each row of ``tokens`` [B, C] (from
    position 0 when a row is shorter): one shape for every step, so a graph can replay it."""
    start = (lengths - width).clamp(min=0)
    positions = start[:, None] + torch.arange(width, device=lengths.device)
    return tokens.gather(1, positions), positions, lengths - 1 - start


class GraphedDrafting:
    """Mixin of model drafters: all γ drafting steps as one device function that a CUDA graph
    can record (:class:`flashspec.graphs.GraphCache`).

    The subclass implements ``_draft(tokens, positions, last_idx, last_pos, gamma, params,
    generator, seed, span)``: a catch-up window [B, w] whose column ``last_idx[b]`` is row b's
    last committed token, then γ drafts at positions ``last_pos[b] + i``. ``span`` None attends
    the whole cache (what a graph needs); ``seed`` (a device scalar) makes sampling counter-based
    (Gumbel-max), else the torch ``generator`` samples. Windows longer than γ + 1 (the first
    step after a prompt) always run eagerly.
    """

    graphs: GraphCache | None = None          # drafting, per (batch, window, γ, params)
    _start_graphs: GraphCache | None = None   # prompt catch-up, per (batch, bucket, buffers)
    _catch_graphs: GraphCache | None = None   # catch-up windows, per (batch, width, buffers)
    _catching_up: bool = False

    def _draft(self, tokens: torch.Tensor, positions: torch.Tensor, last_idx: torch.Tensor,
               last_pos: torch.Tensor, gamma: int, params: SamplingParams,
               generator: torch.Generator | None, seed: torch.Tensor | None, span: int | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @property
    def catching_up(self) -> bool:
        return self._catching_up

    @property
    def capture_s(self) -> float:
        """Capture time of every graph of this drafter: drafting, prompt catch-up, catch-up."""
        caches = (self.graphs, self._start_graphs, self._catch_graphs)
        return sum(c.capture_s for c in caches if c is not None)

    def prepare_graphs(self, batch: int, gamma: int, params: SamplingParams,
                       device: torch.device, capture: bool) -> None:
        """Draft through static buffers from now on (CUDA graphs when ``capture``), capturing
        every (γ' <= γ, window <= γ' + 1) drafting shape up front (the cold start). Dummy
        windows write drafter cache slots that a prompt rewrites before they are read."""
        if self.graphs is None or self.graphs.capture != capture:
            self.graphs = GraphCache(self._replayed, capture)
        if not capture:
            return
        for g in range(1, gamma + 1):
            for w in range(1, g + 2):
                if (batch, w, g, params) in self.graphs.slots:
                    continue
                pos = torch.arange(w, device=device).expand(batch, w).contiguous()
                last = torch.full((batch,), w - 1, dtype=torch.long, device=device)
                seed = torch.zeros((), dtype=torch.long, device=device)
                self.graphs((batch, w, g, params), pos, pos, last, last + 1, seed)

    def _replayed(self, key: tuple, tokens: torch.Tensor, positions: torch.Tensor,
                  last_idx: torch.Tensor, last_pos: torch.Tensor, seed: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, gamma, params = key
        return self._draft(tokens, positions, last_idx, last_pos, gamma, params, None,
                           None if params.greedy else seed, None)

    resident = True

    def _catch_up(self, tokens: torch.Tensor, positions: torch.Tensor, span: int | None) -> None:
        """Run the drafter over a window (its cache slots become valid); no drafting. ``span``
        None: the whole cache."""
        raise NotImplementedError

    def resident_start(self, state: DecodeState, capture: bool = False) -> None:
        """Run the drafter over the prompts (its cache slots become valid). As with the
        target's :class:`flashspec.graphs.Prefill`, the window is padded to a bucket of
        ``graphs.PREFILL_BUCKET`` tokens (the padding writes only slots past the prompts, which the
        steps rewrite before reading) and, with ``capture``, replayed as a CUDA graph per
        (batch, bucket)."""
        width = bucketed(max(state.lengths), state.tokens.shape[1])
        tokens, positions = state.window([0] * state.batch, width)
        graphs = self._window_graphs("_start_graphs", lambda k, t, p: self._catch_up(t, p, k[1]),
                                     capture)
        graphs((state.batch, width, self.resident_buffers()), tokens, positions)

    def resident_catch_up(self, tokens: torch.Tensor, lengths: torch.Tensor, width: int,
                          capture: bool = False) -> None:
        """The window of the last ``width`` committed tokens through ``_catch_up`` over the
        whole cache; one CUDA graph per (batch, width) with ``capture``."""
        self._catch_up_graphs(capture)((tokens.shape[0], width, self.resident_buffers()),
                                       tokens, lengths)

    def prepare_catch_up(self, tokens: torch.Tensor, lengths: torch.Tensor,
                         widths: Sequence[int], capture: bool = True) -> None:
        """Record the catch-up graphs of ``widths`` this drafter lacks for the batch; the
        recorded ones are not replayed (``capture=False``: the same slots, run eagerly)."""
        graphs = self._catch_up_graphs(capture)
        for width in widths:
            graphs.prepare((tokens.shape[0], width, self.resident_buffers()), tokens, lengths)

    def _catch_up_graphs(self, capture: bool) -> GraphCache:
        return self._window_graphs(
            "_catch_graphs", lambda k, t, n: self._catch_up(*resident_window(t, n, k[1])[:2], None),
            capture)

    def _window_graphs(self, attr: str, fn, capture: bool) -> GraphCache:
        """The :class:`GraphCache` kept in ``attr`` (keys: batch, width, drafter buffers), built
        anew when the capture mode changed or the drafter reallocated its buffers since its
        graphs were recorded."""
        graphs, buffers = getattr(self, attr), self.resident_buffers()
        if graphs is None or graphs.capture != capture or any(k[2] != buffers for k in graphs.slots):
            pool = torch.cuda.graph_pool_handle() if capture else None
            graphs = GraphCache(fn, capture, pool)
            setattr(self, attr, graphs)
        return graphs

    def resident_draft(self, tokens: torch.Tensor, lengths: torch.Tensor, gamma: int,
                       params: SamplingParams, seed: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, None]:
        """Re-read the last γ + 1 committed tokens (a fixed window: one graph shape; the slots
        it rewrites hold the same values or stale speculative ones), then draft γ tokens."""
        window, positions, last = resident_window(tokens, lengths, gamma + 1)
        drafts, logits = self._draft(window, positions, last, lengths, gamma,
                                     params, None, None if params.greedy else seed, None)
        return drafts, None if params.greedy else logits, None   # greedy verify ignores q

    def _drafts(self, state: DecodeState, starts: list[int], width: int, gamma: int,
                params: SamplingParams, generator: torch.Generator | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts and their logits from the window of ``width`` tokens at ``starts``."""
        dev = state.device
        self._catching_up = width > gamma + 1
        tokens, positions = state.window(starts, width)
        last_idx = torch.tensor([n - 1 - s for n, s in zip(state.lengths, starts)], device=dev)
        last_pos = torch.tensor(state.lengths, device=dev)
        if self.graphs is None or width > gamma + 1:
            return self._draft(tokens, positions, last_idx, last_pos, gamma, params, generator,
                               None, max(state.lengths))
        seed = (torch.zeros((), dtype=torch.long, device=dev) if params.greedy else
                torch.randint(0, 1 << 31, (), device=dev, generator=generator))
        return self.graphs((state.batch, width, gamma, params), tokens, positions, last_idx,
                           last_pos, seed)

