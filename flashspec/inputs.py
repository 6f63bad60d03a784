"""Checks of what a caller hands the decoding library: prompts (token ids) and token budgets.

Each failure is one FlashSpecError line naming the prompt (and position) at fault, raised before
any tensor is built, so a bad id never reaches an embedding lookup (an out-of-range id is a
device-side assert on a GPU and a silent wrong row nowhere).
"""
from __future__ import annotations

import numbers
from typing import Any

import torch

from flashspec.errors import FlashSpecError


def check_prompts(prompts: Any, vocab_size: int) -> None:
    """A non-empty batch; each prompt a non-empty 1-D sequence of integer token ids (Python ints
    or an integer tensor, never floats or bools) with 0 <= id < ``vocab_size``."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise FlashSpecError(f"prompts must be a list of token-id lists, got "
                             f"{type(prompts).__name__}; tokenize the text first")
    if len(prompts) == 0:
        raise FlashSpecError("prompts is empty; pass at least one prompt (a list of token ids)")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, torch.Tensor):
            _check_tensor(i, prompt, vocab_size)
            continue
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
            raise FlashSpecError(f"prompt {i} is a {type(prompt).__name__}, not a sequence of "
                                 "token ids; tokenize the text first")
        if len(prompt) == 0:
            raise FlashSpecError(f"empty prompt: prompt {i} has no tokens; every prompt needs "
                                 "at least one (e.g. BOS)")
        for j, tok in enumerate(prompt):
            if isinstance(tok, bool) or not isinstance(tok, numbers.Integral):
                raise FlashSpecError(f"prompt {i} position {j} is {tok!r} "
                                     f"({type(tok).__name__}); token ids must be integers")
            if not 0 <= tok < vocab_size:
                raise FlashSpecError(f"prompt {i} position {j} is token id {tok}, outside the "
                                     f"vocabulary [0, {vocab_size}); was it tokenized for "
                                     "another model?")


def _check_tensor(i: int, prompt: torch.Tensor, vocab_size: int) -> None:
    if prompt.dtype == torch.bool or prompt.is_floating_point() or prompt.is_complex():
        raise FlashSpecError(f"prompt {i} is a {prompt.dtype} tensor; token ids must be an "
                             "integer tensor (e.g. torch.long)")
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise FlashSpecError(f"prompt {i} has shape {tuple(prompt.shape)} (an empty prompt or not "
                             "1-D); each prompt must be a non-empty 1-D tensor of token ids")
    lo, hi = int(prompt.min()), int(prompt.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        j = int((prompt == bad).nonzero()[0, 0])
        raise FlashSpecError(f"prompt {i} position {j} is token id {bad}, outside the vocabulary "
                             f"[0, {vocab_size}); was it tokenized for another model?")


def check_max_new_tokens(max_new_tokens: Any) -> None:
    """A positive integer (not a bool, not a float such as 2.0)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) \
            or max_new_tokens < 1:
        raise FlashSpecError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")


def check_generate_inputs(prompts: Any, max_new_tokens: Any, vocab_size: int) -> None:
    """Both checks above: what ``SpecEngine.generate`` runs first."""
    check_max_new_tokens(max_new_tokens)
    check_prompts(prompts, vocab_size)
