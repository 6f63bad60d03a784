"""What a caller may hand verification, checked in one place before any backend runs.

The public entries (:func:`flashspec.verify.verify`, :func:`flashspec.verify.verify_tree`) call
:func:`check_verify` / :func:`check_verify_tree` first; a bad argument raises one line naming it
and the bad value or shape: TypeError for a wrong type or dtype, :class:`FlashSpecError` (a
ValueError) for a wrong shape or value, FloatingPointError for NaN/+inf logits or a row of only
-inf (no token has probability: nothing may be emitted). The value checks (token ranges,
temperatures, finite logits, tree structure) read the tensors: on CUDA a host synchronisation,
which is why backends take their inputs unchecked: the engine's decode loop calls
``Backend.verify`` / ``Backend.verify_tree`` directly and its inputs are valid by construction.
The triton backends run :func:`check_shapes` / :func:`check_tree_shapes` themselves (host
metadata only, no device read).
"""
from __future__ import annotations

import numbers

import torch

from flashspec.core import T_MIN, SamplingParams, TreeDraft
from flashspec.errors import FlashSpecError
from flashspec.verify.sampling import check_finite


def check_shapes(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                 draft_logits: torch.Tensor | None) -> None:
    """target_logits [B, γ+1, V], draft_tokens [B, γ], draft_logits [B, γ, V] or None (shapes
    only: no device read)."""
    if target_logits.dim() != 3 or draft_tokens.dim() != 2:
        raise FlashSpecError(f"expected target_logits [B, γ+1, V] and draft_tokens [B, γ], got "
                             f"{tuple(target_logits.shape)} and {tuple(draft_tokens.shape)}")
    b, g = draft_tokens.shape
    if tuple(target_logits.shape[:2]) != (b, g + 1):
        raise FlashSpecError(f"target_logits {tuple(target_logits.shape)} does not match "
                             f"draft_tokens {tuple(draft_tokens.shape)}: need [B, γ+1, V]")
    if draft_logits is not None and tuple(draft_logits.shape) != (b, g, target_logits.shape[2]):
        raise FlashSpecError(f"draft_logits {tuple(draft_logits.shape)} must be [B, γ, V] = "
                             f"{(b, g, target_logits.shape[2])}")


def check_tree_shapes(target_logits: torch.Tensor, draft: TreeDraft) -> None:
    """target_logits [B, N+1, V]; the draft's tokens, parents, depth [B, N+1], its logits
    [B, N+1, V] or None (shapes only: no device read)."""
    if target_logits.dim() != 3:
        raise FlashSpecError(f"expected target_logits [B, N + 1, V], got "
                             f"{tuple(target_logits.shape)}")
    shape = tuple(target_logits.shape[:2])
    for name, t in (("tokens", draft.tokens), ("parents", draft.parents), ("depth", draft.depth)):
        if tuple(t.shape) != shape:
            raise FlashSpecError(f"draft {name} {tuple(t.shape)} does not match target_logits "
                                 f"{tuple(target_logits.shape)}: need [B, N + 1]")
    if draft.logits is not None and draft.logits.shape != target_logits.shape:
        raise FlashSpecError(f"draft logits {tuple(draft.logits.shape)} must be [B, N + 1, V] "
                             f"like target_logits {tuple(target_logits.shape)}")


def check_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                 draft_logits: torch.Tensor | None, params: SamplingParams,
                 seed: int | torch.Tensor, temperature: torch.Tensor | None) -> None:
    """Everything :func:`flashspec.verify.verify` is handed (reads the tensors)."""
    _tensor(target_logits, "target_logits", floating=True)
    _tensor(draft_tokens, "draft_tokens", floating=False)
    if draft_logits is not None:
        _tensor(draft_logits, "draft_logits", floating=True)
    check_shapes(target_logits, draft_tokens, draft_logits)
    _vocab(target_logits)
    _same_device(target_logits, draft_tokens=draft_tokens, draft_logits=draft_logits)
    _params_seed_temperature(params, seed, temperature, target_logits.shape[0])
    _token_range(draft_tokens, target_logits.shape[2], "draft_tokens")
    _logits_values(target_logits, "target_logits")
    if draft_logits is not None:
        _logits_values(draft_logits, "draft_logits")


def check_verify_tree(target_logits: torch.Tensor, draft: TreeDraft, params: SamplingParams,
                      seed: int | torch.Tensor, temperature: torch.Tensor | None,
                      depth: int | None) -> None:
    """Everything :func:`flashspec.verify.verify_tree` is handed (reads the tensors): also the
    tree itself (node 0 the root, each other node's parent an earlier node, depths counting
    from the root) and ``depth`` (at least the deepest node)."""
    _tensor(target_logits, "target_logits", floating=True)
    if not isinstance(draft, TreeDraft):
        raise TypeError(f"draft must be a flashspec.core.TreeDraft, got {type(draft).__name__}")
    for name in ("tokens", "parents", "depth"):
        _tensor(getattr(draft, name), f"draft.{name}", floating=False)
    if draft.logits is not None:
        _tensor(draft.logits, "draft.logits", floating=True)
    check_tree_shapes(target_logits, draft)
    _vocab(target_logits)
    _same_device(target_logits, **{"draft.tokens": draft.tokens, "draft.parents": draft.parents,
                                   "draft.depth": draft.depth, "draft.logits": draft.logits})
    _params_seed_temperature(params, seed, temperature, target_logits.shape[0])
    _token_range(draft.tokens, target_logits.shape[2], "draft.tokens")
    _tree_structure(draft.parents, draft.depth)
    if depth is not None:
        deepest = int(draft.depth.max()) if draft.depth.numel() else 0
        if not _integer(depth) or depth < deepest:
            raise FlashSpecError(f"depth must be an integer >= the deepest node ({deepest}), "
                                 f"got {depth!r}")
    _logits_values(target_logits, "target_logits")
    if draft.logits is not None:
        _logits_values(draft.logits, "draft.logits")


def _integer(x: object) -> bool:
    """An integer, not a bool (True would pass as 1)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _tensor(t: object, name: str, floating: bool) -> None:
    """A tensor of floating (logits) or integer (token ids) dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    ok = t.is_floating_point() if floating else not (
        t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
    if not ok:
        raise TypeError(f"{name} must have {'a floating' if floating else 'an integer'} "
                        f"dtype, got {t.dtype}")


def _vocab(target_logits: torch.Tensor) -> None:
    if target_logits.shape[2] == 0:
        raise FlashSpecError(f"target_logits {tuple(target_logits.shape)} has no vocabulary "
                             f"(V = 0)")


def _same_device(target_logits: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.device != target_logits.device:
            raise FlashSpecError(f"{name} is on {t.device} but target_logits on "
                                 f"{target_logits.device}: put them on one device")


def _params_seed_temperature(params: object, seed: object, temperature: object,
                             batch: int) -> None:
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be flashspec.verify.SamplingParams, got "
                        f"{type(params).__name__}")
    if isinstance(seed, torch.Tensor):
        if seed.numel() != 1 or seed.is_floating_point() or seed.is_complex() or (
                seed.dtype == torch.bool):
            raise TypeError(f"seed must be an int or a one-element integer tensor, got a "
                            f"{seed.dtype} tensor of shape {tuple(seed.shape)}")
    elif not _integer(seed):
        raise TypeError(f"seed must be an int or a one-element integer tensor, got {seed!r}")
    if temperature is None:
        return
    if not isinstance(temperature, torch.Tensor):
        raise TypeError(f"temperature must be a tensor of per-row temperatures [B] or None (a "
                        f"scalar goes in params), got {type(temperature).__name__}")
    if temperature.is_complex() or temperature.dtype == torch.bool:
        raise TypeError(f"temperature must have a real dtype, got {temperature.dtype}")
    if temperature.numel() != batch:
        raise FlashSpecError(f"temperature must hold one value per row: {batch}, got shape "
                             f"{tuple(temperature.shape)}")
    t = temperature.reshape(-1).float()             # what every backend computes with
    bad = ~(torch.isfinite(t) & ((t == 0) | (t >= T_MIN)))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise FlashSpecError(f"temperature[{row}] must be 0 (greedy) or a finite number >= "
                             f"{T_MIN}, got {temperature.reshape(-1)[row].item()!r}")


def _token_range(tokens: torch.Tensor, vocab: int, name: str) -> None:
    bad = (tokens < 0) | (tokens >= vocab)
    if bool(bad.any()):
        at = tuple(bad.nonzero()[0].tolist())
        raise FlashSpecError(f"{name}{list(at)} = {int(tokens[at])} is not a token id in "
                             f"[0, {vocab})")


def _logits_values(logits: torch.Tensor, name: str) -> None:
    """No NaN or +inf (the references' own check), and every row has a token of finite logit."""
    check_finite(logits, name)
    empty = logits.amax(-1) == float("-inf")
    if bool(empty.any()):
        at = list(empty.nonzero()[0].tolist())
        raise FloatingPointError(f"{name}{at} is all -inf: no token has probability; refusing "
                                 f"to emit tokens")


def _tree_structure(parents: torch.Tensor, depth: torch.Tensor) -> None:
    """Node 0 is the root (parent -1, depth 0); node i's parent is an earlier node and its
    depth one more than its parent's."""
    if parents.numel() == 0:
        return
    ids = torch.arange(parents.shape[1], device=parents.device)
    bad_root = (parents[:, 0] != -1) | (depth[:, 0] != 0)
    if bool(bad_root.any()):
        b = int(bad_root.nonzero()[0, 0])
        raise FlashSpecError(f"draft row {b}: node 0 must be the root (parent -1, depth 0), got "
                             f"parent {int(parents[b, 0])}, depth {int(depth[b, 0])}")
    bad = (parents[:, 1:] < 0) | (parents[:, 1:] >= ids[1:])
    if bool(bad.any()):
        b, i = bad.nonzero()[0].tolist()
        raise FlashSpecError(f"draft.parents[{b}, {i + 1}] = {int(parents[b, i + 1])}: a node's "
                             f"parent must be an earlier node (0 <= parent < {i + 1})")
    want = depth.gather(1, parents[:, 1:].long()) + 1
    bad = depth[:, 1:] != want
    if bool(bad.any()):
        b, i = bad.nonzero()[0].tolist()
        raise FlashSpecError(f"draft.depth[{b}, {i + 1}] = {int(depth[b, i + 1])}: must be its "
                             f"parent's depth + 1 = {int(want[b, i])}")
