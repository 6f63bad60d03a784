"""Training/evaluation data for drafter heads from the real model (native flashspec.models API).

* ``greedy_generate``: the target's own greedy continuations (the text a drafter drafts on),
  batched with right padding on the static KV cache.
* ``collect_states``: for each (prompt, continuation), the layer-skip drafter's hidden states
  (first-k layers, after the final norm) and the target's final hidden states at every
  position that predicts a continuation token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm


@dataclass
class HeadData:
    """Aligned rows: drafter hidden [N, d], target hidden [N, d], next token [N], prompt index."""

    drafter: torch.Tensor
    target: torch.Tensor
    next_token: torch.Tensor
    prompt_index: torch.Tensor
    prompt_ids: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return self.drafter.shape[0]


@torch.no_grad()
def greedy_generate(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    eos_id: int | None = None, batch_size: int = 8, progress: bool = True
                    ) -> list[list[int]]:
    """Greedy continuations (EOS included when produced) of token-id prompts."""
    out: list[list[int]] = []
    starts = range(0, len(prompts), batch_size)
    for start in tqdm(starts, desc="target greedy", disable=not progress):
        out.extend(_greedy_batch(model, prompts[start:start + batch_size], max_new_tokens, eos_id))
    return out


def _greedy_batch(model: Any, prompts: Sequence[Sequence[int]], max_new: int,
                  eos_id: int | None) -> list[list[int]]:
    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    dev = model.device
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p)
    cache = model.new_cache(len(prompts), width + max_new)
    positions = torch.arange(width)[None].expand(len(prompts), -1)
    logits = model(tokens.to(dev), positions.to(dev), cache, span=width)
    nxt = logits[torch.arange(len(prompts)), lengths - 1].argmax(-1).cpu()
    gen: list[list[int]] = [[] for _ in prompts]
    done = torch.zeros(len(prompts), dtype=torch.bool)
    pos = lengths.clone()
    for step in range(max_new):
        for i in range(len(prompts)):
            if not done[i]:
                gen[i].append(int(nxt[i]))
        if eos_id is not None:
            done |= nxt == eos_id
        if bool(done.all()) or step == max_new - 1:
            break
        logits = model(nxt[:, None].to(dev), pos[:, None].to(dev), cache, span=int(pos.max()) + 1)
        nxt = logits[:, -1].argmax(-1).cpu()
        pos += 1
    return gen


@torch.no_grad()
def collect_states(model: Any, prompts: Sequence[Sequence[int]],
                   continuations: Sequence[Sequence[int]], drafter_layers: Sequence[int],
                   prompt_ids: Sequence[str] | None = None, batch_size: int = 8,
                   progress: bool = True) -> HeadData:
    """Hidden states at positions len(prompt)-1 .. len(prompt)+len(cont)-2 of each sequence.

    Row j of a sequence predicts continuation token j: ``next_token`` holds it. Sequences are
    right-padded into batches (the causal mask keeps padding out of real positions).
    """
    drafter, target, nxt, owner = [], [], [], []
    seqs = [([*p, *c], len(p), len(c)) for p, c in zip(prompts, continuations)]
    starts = range(0, len(seqs), batch_size)
    for start in tqdm(starts, desc="hidden states", disable=not progress):
        chunk = seqs[start:start + batch_size]
        h_d, h_t = _hidden_pair(model, [s for s, _, _ in chunk], list(drafter_layers))
        for j, (seq, n_prompt, n_cont) in enumerate(chunk):
            lo, hi = n_prompt - 1, n_prompt + n_cont - 1
            drafter.append(h_d[j, lo:hi])
            target.append(h_t[j, lo:hi])
            nxt.append(torch.tensor(seq[n_prompt:], dtype=torch.long))
            owner.append(torch.full((n_cont,), start + j, dtype=torch.long))
    return HeadData(torch.cat(drafter), torch.cat(target), torch.cat(nxt), torch.cat(owner),
                    list(prompt_ids or []))


def _hidden_pair(model: Any, seqs: list[list[int]], layers: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafter hidden, target hidden) [B, n, d] float32 on CPU for right-padded sequences."""
    width = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = torch.tensor(s)
    tokens = tokens.to(model.device)
    pos = torch.arange(width, device=model.device)[None].expand(len(seqs), -1)
    n_layers = model.shape.num_layers
    if layers == list(range(len(layers))):  # a prefix drafter: reuse its residual stream
        x = model.run_layers(model.embed_tokens(tokens), pos, None, layers)
        h_d = model.norm(x)
        h_t = model.norm(model.run_layers(x, pos, None, list(range(len(layers), n_layers))))
    else:
        h_d = model.forward_hidden(tokens, pos, layers=layers)
        h_t = model.forward_hidden(tokens, pos)
    return h_d.float().cpu(), h_t.float().cpu()
