"""Distil a low-rank head: minimise KL(teacher || student) on drafter hidden states.

The teacher is the drafter's full head applied to the same hidden states (default), or the
target's distribution when ``teacher_inputs`` (e.g. the target's final hidden states) and a
matching ``teacher_logits_fn`` are given. Training prompts must be disjoint from evaluation
prompts: pass both id lists and they are checked and recorded on ``head.distill_info``.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from flashspec.errors import FlashSpecError
from flashspec.heads.modules import LowRankHead

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
Batch = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def kl_rows(teacher_logits: torch.Tensor, student_logits: torch.Tensor,
            temperature: float = 1.0) -> torch.Tensor:
    """KL(softmax(t/T) || softmax(s/T)) per row, in float32 (tokens with p_t = 0 add nothing)."""
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    p_t = log_t.exp()
    return torch.where(p_t > 0, p_t * (log_t - log_s), torch.zeros_like(p_t)).sum(-1)


@torch.no_grad()
def evaluate_head(head: torch.nn.Module, hidden: torch.Tensor, teacher_logits_fn: LogitsFn,
                  teacher_inputs: torch.Tensor | None = None, batch_size: int = 512,
                  temperature: float = 1.0) -> dict[str, float]:
    """Mean KL(teacher || head) and top-1 agreement (argmax head == argmax teacher)."""
    kl_sum, agree, n = 0.0, 0, 0
    for start in range(0, hidden.shape[0], batch_size):
        h = hidden[start:start + batch_size]
        t_in = h if teacher_inputs is None else teacher_inputs[start:start + batch_size]
        t, s = teacher_logits_fn(t_in), head(h)
        kl_sum += float(kl_rows(t, s, temperature).sum())
        agree += int((t.argmax(-1) == s.argmax(-1)).sum())
        n += h.shape[0]
    if n == 0:
        raise FlashSpecError("evaluate_head got no hidden states")
    return {"kl": kl_sum / n, "top1": agree / n, "n": n}


@torch.no_grad()
def agreement_metrics(head: torch.nn.Module, hidden: torch.Tensor, full_head: LogitsFn,
                      target_logits_fn: LogitsFn | None = None,
                      target_inputs: torch.Tensor | None = None,
                      batch_size: int = 512) -> dict[str, float | None]:
    """How well ``head`` stands in for the drafter's full head, and how it fares on the target.

    kl_full: KL(full || head), None when the head gives -inf to a token the full head can
    emit (truncation); full_mass_kept: mean full-head probability on the tokens the head can
    emit; top1_full: argmax agreement with the full head. With the
    target (logits fn on ``target_inputs``, aligned with ``hidden``): top1_target = greedy
    acceptance proxy (argmax head == argmax target) and accept_t1 = E sum_v min(p, q), the
    acceptance probability of one draft at temperature 1 (q = softmax of the head).
    """
    sums = {"kl_full": 0.0, "full_mass_kept": 0.0, "top1_full": 0.0, "top1_target": 0.0,
            "accept_t1": 0.0}
    n = hidden.shape[0]
    for start in range(0, n, batch_size):
        h = hidden[start:start + batch_size]
        z, z_full = head(h).float(), full_head(h).float()
        sums["kl_full"] += float(kl_rows(z_full, z).sum())
        p_full = F.softmax(z_full, -1)
        sums["full_mass_kept"] += float(torch.where(z > float("-inf"), p_full, 0.0).sum())
        sums["top1_full"] += float((z.argmax(-1) == z_full.argmax(-1)).sum())
        if target_logits_fn is not None and target_inputs is not None:
            p = F.softmax(target_logits_fn(target_inputs[start:start + batch_size]).float(), -1)
            sums["top1_target"] += float((z.argmax(-1) == p.argmax(-1)).sum())
            sums["accept_t1"] += float(torch.minimum(p, F.softmax(z, -1)).sum())
    out: dict[str, float | None] = {k: v / n for k, v in sums.items()}
    if not math.isfinite(out["kl_full"]):
        out["kl_full"] = None
    if target_logits_fn is None or target_inputs is None:
        out = {k: out[k] for k in ("kl_full", "full_mass_kept", "top1_full")}
    return {**out, "n": n}


def check_disjoint(train_ids: Sequence[str] | None, eval_ids: Sequence[str] | None) -> None:
    """Raise if a prompt id is used both for training and for evaluation."""
    overlap = set(train_ids or ()) & set(eval_ids or ())
    if overlap:
        raise FlashSpecError(f"{len(overlap)} prompt ids are in both the distillation and the "
                             f"evaluation set (e.g. {sorted(overlap)[:3]}); use disjoint splits")


def _batches(hidden: torch.Tensor | Iterable[Batch], teacher_inputs: torch.Tensor | None,
             batch_size: int, gen: torch.Generator) -> Iterator[Batch]:
    """Endless random minibatches of a tensor, or the items of an iterator as they come."""
    if not isinstance(hidden, torch.Tensor):
        yield from hidden
        return
    if teacher_inputs is not None and teacher_inputs.shape[0] != hidden.shape[0]:
        raise FlashSpecError("teacher_inputs and hidden must have the same number of rows")
    n = hidden.shape[0]
    while True:
        idx = torch.randperm(n, generator=gen)
        for start in range(0, n - min(batch_size, n) + 1, min(batch_size, n)):
            rows = idx[start:start + batch_size].to(hidden.device)
            yield hidden[rows] if teacher_inputs is None else (hidden[rows], teacher_inputs[rows])


def _lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10 % of ``lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def distill_lowrank(head: LowRankHead, hidden: torch.Tensor | Iterable[Batch],
                    teacher_logits_fn: LogitsFn, steps: int, lr: float = 1e-3,
                    temperature: float = 1.0, batch_size: int = 256,
                    teacher_inputs: torch.Tensor | None = None,
                    eval_hidden: torch.Tensor | None = None,
                    eval_teacher_inputs: torch.Tensor | None = None, eval_every: int = 0,
                    train_prompt_ids: Sequence[str] | None = None,
                    eval_prompt_ids: Sequence[str] | None = None, seed: int = 0,
                    logger: Any = None, progress: bool = True, data_description: str = "",
                    teacher_name: str = "full_head") -> list[dict[str, Any]]:
    """Train ``head`` in place with Adam on KL(teacher || student) (x T^2); return the curve.

    ``hidden`` is a tensor [N, d] (shuffled minibatches) or an iterator of [n, d] batches or
    (hidden, teacher_input) pairs. Held-out metrics (``eval_hidden``) are added to the curve
    at step 0, every ``eval_every`` steps and at the end. ``logger`` is an optional
    WandbLogger. The settings and prompt ids land on ``head.distill_info`` (saved by save_head).
    """
    if steps < 1:
        raise FlashSpecError(f"distillation steps={steps}; use at least 1")
    check_disjoint(train_prompt_ids, eval_prompt_ids)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    warmup = max(1, steps // 20)
    curve: list[dict[str, Any]] = []

    def evaluate(step: int) -> dict[str, Any]:
        if eval_hidden is None:
            return {}
        head.eval()
        m = evaluate_head(head, eval_hidden, teacher_logits_fn, eval_teacher_inputs,
                          temperature=temperature)
        head.train()
        return {"eval_kl": m["kl"], "eval_top1": m["top1"]}

    start = {"step": 0, **evaluate(0)}
    if len(start) > 1:
        curve.append(start)
        _log(logger, start)
    batches = _batches(hidden, teacher_inputs, batch_size, gen)
    head.train()
    bar = tqdm(range(1, steps + 1), desc=f"distill r={head.rank}", disable=not progress)
    for step in bar:
        batch = next(batches, None)
        if batch is None:  # a finite iterator ran out: close the curve with a held-out point
            if curve and "eval_kl" not in curve[-1] and curve[-1]["step"] > 0:
                curve[-1].update(evaluate(curve[-1]["step"]))
            break
        h, t_in = batch if isinstance(batch, tuple) else (batch, batch)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step - 1, steps, lr, warmup)
        with torch.no_grad():
            teacher = teacher_logits_fn(t_in)
        loss = kl_rows(teacher, head(h), temperature).mean() * temperature ** 2
        opt.zero_grad(set_to_none=True)
        loss.backward()
        loss = loss.detach()
        opt.step()
        entry: dict[str, Any] = {"step": step, "loss": loss.item(), "lr": opt.param_groups[0]["lr"]}
        if (eval_every and step % eval_every == 0) or step == steps:
            entry.update(evaluate(step))
        curve.append(entry)
        _log(logger, entry)
        bar.set_postfix(loss=f"{entry['loss']:.4f}")
    head.eval()
    done = max((c["step"] for c in curve), default=0)
    head.distill_info = {"distill_steps": done, "distill_lr": lr,
                         "distill_temperature": temperature, "distill_batch_size": batch_size,
                         "distill_seed": seed, "teacher": teacher_name, "data": data_description,
                         "train_prompt_ids": list(train_prompt_ids or []),
                         "eval_prompt_ids": list(eval_prompt_ids or [])}
    if logger is not None and curve:
        logger.summary({k: v for k, v in curve[-1].items() if k != "step"})
    return curve


def _log(logger: Any, entry: dict[str, Any]) -> None:
    if logger is not None:
        logger.log({f"distill/{k}": v for k, v in entry.items() if k != "step"}, step=entry["step"])
