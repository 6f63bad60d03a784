"""Training loop of the EAGLE-style drafter on target features and target distributions.

Loss per unrolled pass j (pass 0 reads true features; pass j > 0 reads the drafter's own
predictions of pass j-1, with the attention pattern it meets while drafting — true slots up to
s-j, its own predicted slots after: EAGLE-3's "training-time test"):

    w_kl · KL(p_target(· | f_s) || q(· | ĥ_s))  +  w_accept · (1 - accept_s)
        +  w_reg · SmoothL1(ĥ_s, f_s)

p_target is the target's exact next-token distribution at s, coarsened to its top-k tokens
plus one bucket for the rest of the vocabulary (the data stores the top-k log-probs); q is the
drafter's full-vocabulary softmax through its head, so the KL is exact on that partition.
accept_s = Σ min(p, q) on the same partition is the probability that speculative sampling at
T = 1 accepts a token the drafter sampled (:class:`TailCrossEntropy`). The
cross-entropy has a hand-written backward (softmax - target) that never materialises more than
one [M, V] float32 buffer. The same code runs on CPU and CUDA (bf16 autocast on either).

Throughput: the data is moved to the device once (:class:`Store`), a batch is built from
host-known index tensors by gathers on the device, and the loop reads the device only every
``log_every`` steps (fused AdamW and TF32 matmuls on CUDA).

Resumable (:class:`Resumable`): the loop writes its whole state (module, trained head,
optimiser, step, every random stream, the epoch's remaining batches, best τ so far) to one file
every ``every`` steps and when a call's time or step limit comes, and a later call continues from
it bit for bit: k steps + pause + resume + k steps give the same weights as 2k straight, so a
long run fits in device calls of a few minutes.
"""
from __future__ import annotations

import copy
import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from flashspec.drafters.eagle import EagleDrafter
from flashspec.drafters.eagle_module import EagleConfig, EagleModule
from flashspec.errors import FlashSpecError
from flashspec.models.llama import LlamaLM
from flashspec.paths import temp_sibling
from flashspec.training.data import DistillData

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    """Optimisation and evaluation knobs (architecture: n_layers, out_norm, init)."""

    steps: int = 2000
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    batch_tokens: int = 2048        # padded tokens per optimiser step
    max_len: int = 640              # sequences are cut to their first max_len tokens
    unroll: int = 2                 # 1 = EAGLE-1; k > 1 also trains on its own k-1 predictions
    unroll_from_step: int = 0       # single pass (cheaper steps) before this step
    unroll_decay: float = 0.8       # weight of pass j is decay**j
    detach_unroll: bool = False
    w_kl: float = 1.0
    w_accept: float = 0.0           # weight of 1 - accept, the T = 1 rejection probability
    w_reg: float = 1.0
    kl_from_step: int = 0           # regression only (no head: much cheaper steps) before this
    reg: str = "smooth_l1"          # smooth_l1 on features | logit_mse: mean squared logit error
    noise: float = 0.0              # N(0, noise) added to the true input features
    loss_on: str = "response"       # response | all : positions that get the KL term
    amp: str = "bf16"               # bf16 | none
    val_fraction: float = 0.03
    eval_every: int = 250
    eval_prompts: int = 2           # per dataset, from the tail of each eval split
    eval_new_tokens: int = 48
    eval_gamma: int = 4
    eval_temperature: float = 0.0   # τ of the held-out decode (picks the best checkpoint) at this T
    log_every: int = 10
    seed: int = 0
    time_budget_s: float | None = None  # stop (with the LR schedule finished) after this long
    n_layers: int = 1
    out_norm: bool = False
    in_norm: bool = False
    init: str = "random"            # random | layer:<i> (copy target block i into every block)
    #                                 | checkpoint:<file> (continue from a trained drafter)

    def __post_init__(self) -> None:
        if self.loss_on not in ("response", "all"):
            raise FlashSpecError(f"loss_on={self.loss_on!r}; choose response or all")
        if self.reg not in ("smooth_l1", "logit_mse"):
            raise FlashSpecError(f"reg={self.reg!r}; choose smooth_l1 or logit_mse")
        if self.amp not in ("bf16", "none"):
            raise FlashSpecError(f"amp={self.amp!r}; choose bf16 or none")
        if self.unroll < 1 or self.steps < 1 or self.batch_tokens < self.max_len:
            raise FlashSpecError("need unroll >= 1, steps >= 1 and batch_tokens >= max_len")


@dataclass
class Batch:
    tokens: torch.Tensor     # [B, n]
    feats: torch.Tensor      # [B, n, d] float32: f_s, the target feature at position s
    valid: torch.Tensor      # [B, n] bool
    region: torch.Tensor     # [B, n] bool: positions that get the KL term
    top_ids: torch.Tensor | None = None    # [B, n, k] int64: target's top-k next tokens at s
    top_logp: torch.Tensor | None = None   # [B, n, k] float32: their log-probabilities
    region_rows: torch.Tensor | None = None  # flat indices of ``region`` (built on the host)
    valid_rows: torch.Tensor | None = None   # flat indices of ``valid``

    def rows(self, x: torch.Tensor, which: str) -> torch.Tensor:
        """``x[mask]`` for mask = region | valid, without a device-to-host sync when the flat
        indices are known."""
        flat = self.region_rows if which == "region" else self.valid_rows
        mask = self.region if which == "region" else self.valid
        return x[mask] if flat is None else x.flatten(0, 1).index_select(0, flat)


@dataclass
class EvalSet:
    """Held-out prompts (token ids) per dataset for τ through the engine."""

    prompts: dict[str, list[list[int]]]
    ids: dict[str, list[str]] = field(default_factory=dict)


# ---------------------------------------------------------------------- module setup
def build_module(target: LlamaLM, cfg: TrainConfig, head: nn.Module | None = None
                 ) -> EagleModule:
    """The drafter module in float32 on the target's device: fresh, or (``init:
    checkpoint:<file>``) a trained drafter's weights, its low-rank head copied into ``head``."""
    gen = torch.Generator().manual_seed(cfg.seed)
    config = EagleConfig(n_layers=cfg.n_layers, out_norm=cfg.out_norm, in_norm=cfg.in_norm)
    module = EagleModule(target.shape, config)
    module.init_weights(generator=gen)
    if cfg.init.startswith("checkpoint:"):
        warm_start(module, head, target, cfg.init.split(":", 1)[1])
        return module.float().to(target.device)
    if cfg.init.startswith("layer:"):
        src = target.layers[int(cfg.init.split(":", 1)[1])].state_dict()
        for block in module.layers:
            block.load_state_dict({k: v.float() for k, v in src.items()})
    elif cfg.init != "random":
        raise FlashSpecError(f"init={cfg.init!r}; choose random, layer:<i> or checkpoint:<file>")
    if module.norm is not None:
        module.norm.weight.data.copy_(target.norm.weight.float())
    return module.to(target.device)


def warm_start(module: EagleModule, head: nn.Module | None, target: LlamaLM, path: str) -> None:
    """Copy a trained drafter (and its low-rank head, when ``head`` is one of the same rank)
    into ``module`` / ``head``; the architecture must match the training config."""
    from flashspec.drafters.eagle_checkpoint import load_eagle
    from flashspec.paths import repo_path
    trained, trained_head, meta = load_eagle(repo_path(path), target)
    if trained.config != module.config:
        raise FlashSpecError(f"init={path}: the checkpoint's drafter is {trained.config}, the "
                             f"training config asks for {module.config}; set train.n_layers, "
                             "train.out_norm and train.in_norm to match")
    module.load_state_dict({k: v.float() for k, v in trained.state_dict().items()})
    if getattr(head, "kind", None) == "lowrank":
        if trained_head is None or trained_head.rank != head.rank:
            raise FlashSpecError(f"init={path}: the checkpoint holds head {meta.get('head')}, the "
                                 f"run trains a rank-{head.rank} head; train the head from its SVD "
                                 "(init=random) or pick a checkpoint of that rank")
        with torch.no_grad():
            head.w_down.copy_(trained_head.w_down.float())
            head.w_up.copy_(trained_head.w_up.float())


# ---------------------------------------------------------------------- batching
@dataclass
class Store:
    """The data as the loop reads it: spans and lengths on the host, content on the device
    (moved once, so a batch is a few gathers on the device and never a host copy). The content
    tensors have one extra last row, the padding (token 0, zero feature, log-probs -1e4)."""

    meta: dict[str, Any]
    starts: list[int]
    lengths: list[int]
    n_prompt: list[int]
    tokens: torch.Tensor        # [N + 1] int64
    features: torch.Tensor      # [N + 1, d] float16 (float32 on a CPU)
    top_ids: torch.Tensor       # [N + 1, k] int32
    top_logp: torch.Tensor      # [N + 1, k] float32

    def __len__(self) -> int:
        return len(self.starts)

    def length(self, i: int) -> int:
        return self.lengths[i]


def to_store(data: DistillData, device) -> Store:
    """``data`` moved to ``device`` (no copy when it is already there)."""
    offsets = data.offsets.tolist()
    lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    def move(t: torch.Tensor, pad: float) -> torch.Tensor:
        t = t.to(device)
        return torch.cat([t, torch.full_like(t[:1], pad)])

    cpu = torch.device(device).type == "cpu"  # float32 features there: no per-batch conversion
    features = data.features.float() if cpu else data.features

    return Store(data.meta, offsets[:-1], lengths, data.n_prompt.tolist(), move(data.tokens, 0),
                 move(features, 0.0), move(data.top_ids, 0), move(data.top_logp, -1e4))


def split_val(data: DistillData | Store, fraction: float, seed: int
              ) -> tuple[list[int], list[int]]:
    """(train, val) sequence indices, split by prompt id so samples of a prompt stay together."""
    seqs = data.meta.get("sequences") or [{"prompt_id": str(i)} for i in range(len(data))]
    prompts = sorted({s["prompt_id"] for s in seqs})
    rng = random.Random(f"eagle-val:{seed}")
    rng.shuffle(prompts)
    n_val = int(round(fraction * len(prompts))) if len(prompts) > 1 else 0
    val_ids = set(prompts[:n_val])
    val = [i for i, s in enumerate(seqs) if s["prompt_id"] in val_ids]
    held = set(val)
    return [i for i in range(len(data)) if i not in held], val


def batches(data: DistillData | Store, indices: Sequence[int], cfg: TrainConfig,
            rng: random.Random) -> list[list[int]]:
    """One epoch of batches: shuffled, then length-sorted within pools, ≤ batch_tokens padded."""
    order = list(indices)
    rng.shuffle(order)
    out: list[list[int]] = []
    pool = 32
    for lo in range(0, len(order), pool):
        chunk = sorted(order[lo:lo + pool], key=lambda i: min(data.length(i), cfg.max_len))
        cur: list[int] = []
        for i in chunk:
            width = min(data.length(i), cfg.max_len)
            if cur and (len(cur) + 1) * width > cfg.batch_tokens:
                out.append(cur)
                cur = []
            cur.append(i)
        if cur:
            out.append(cur)
    rng.shuffle(out)
    return out


def collate(data: Store, idx: Sequence[int], cfg: TrainConfig) -> Batch:
    """A padded batch of sequences ``idx`` (cut to max_len): index tensors are built on the host
    (lengths and prompt lengths are known there), the content is gathered on the device."""
    lens = torch.tensor([min(data.lengths[i], cfg.max_len) for i in idx])
    width = int(lens.max())
    pos = torch.arange(width)[None]
    valid = pos < lens[:, None]
    prompt = torch.tensor([data.n_prompt[i] for i in idx])
    region = valid & (pos >= prompt[:, None] - 1) if cfg.loss_on == "response" else valid
    starts = torch.tensor([data.starts[i] for i in idx])
    gather = torch.where(valid, starts[:, None] + pos, data.tokens.shape[0] - 1)  # last: padding
    dev = data.tokens.device
    send = lambda t: t.to(dev, non_blocking=True)
    flat = send(gather.flatten())
    take = lambda t: t.index_select(0, flat).view(*gather.shape, *t.shape[1:])
    return Batch(
        tokens=take(data.tokens), feats=take(data.features).float(),
        valid=send(valid), region=send(region),
        top_ids=take(data.top_ids).long(), top_logp=take(data.top_logp).float(),
        region_rows=send(region.flatten().nonzero().squeeze(1)),
        valid_rows=send(valid.flatten().nonzero().squeeze(1)))


# ---------------------------------------------------------------------- forward + loss
def shift(x: torch.Tensor) -> torch.Tensor:
    """Slot s reads the feature of position s-1 (zeros at slot 0)."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


def unroll_mask(n: int, depth: int, device) -> torch.Tensor:
    """Bool [1, 1, (depth+1)n, (depth+1)n] over chunks 0..depth (chunk a = pass a's inputs).

    Query (a, s) sees key (0, t) for t <= s - a and key (c, s - a + c) for 1 <= c <= a: the
    true slots before the a drafted ones, then its own chain of predicted slots.
    """
    k = depth + 1
    a = torch.arange(k, device=device).repeat_interleave(n)
    s = torch.arange(n, device=device).repeat(k)
    qa, qs, ka, ks = a[:, None], s[:, None], a[None, :], s[None, :]
    true_part = (ka == 0) & (ks <= qs - qa)
    chain = (ka >= 1) & (ka <= qa) & (ks == qs - qa + ka)
    return (true_part | chain)[None, None]


def forward_passes(module: EagleModule, target: LlamaLM, batch: Batch, cfg: TrainConfig,
                   generator: torch.Generator | None = None, unroll: int | None = None
                   ) -> list[torch.Tensor]:
    """Predicted features [B, n, d] of every unrolled pass (``unroll`` defaults to cfg's)."""
    b, n = batch.tokens.shape
    pos = torch.arange(n, device=batch.tokens.device)[None].expand(b, -1)
    embeds = target.embed_tokens(batch.tokens).float()
    first = shift(batch.feats)
    if cfg.noise > 0:
        noise = torch.randn(first.shape, generator=generator, device="cpu").to(first.device)
        first = first + cfg.noise * noise
    inputs, outs = [first], []
    for j in range(cfg.unroll if unroll is None else unroll):
        if j:
            prev = outs[-1].detach() if cfg.detach_unroll else outs[-1]
            inputs.append(shift(prev))
        k = j + 1
        p = pos.repeat(1, k)
        mask = unroll_mask(n, j, pos.device) if j else LlamaLM.attention_mask(pos, n, False)
        out = module(torch.cat(inputs, 1), embeds.repeat(1, k, 1), target.rope(p), p, mask)
        outs.append(out[:, j * n:])
    return outs


class TailCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of softmax(x W^T) against a top-k + tail-bucket target, and the
    acceptance probability of one sampled draft token on the same partition.

    loss = -Σ_k p_k log q_k - p_tail log q_tail; with Σ_k p_k + p_tail = 1 its gradient wrt the
    logits is q - p on the k ids and q (1 - p_tail / q_tail) elsewhere.

    accept = Σ_k min(p_k, q_k) + min(p_tail, q_tail): speculative sampling at T = 1 accepts a
    token drawn from q with probability Σ_v min(p_v, q_v) (1 - the total variation), and this is
    that sum with the tail coarsened to one bucket (an upper bound). Its gradient wrt logit i is
    q_i (c_i - C): c_i = 1 where q is below p on i's part (its top id, or the tail bucket), and
    C = Σ_i q_i c_i. Training on 1 - accept (the LK losses' direct acceptance objective) puts the
    drafter's limited capacity where sampling gains, which the KL alone, being mass-covering,
    does not.

    ``dtype`` is the matmul dtype (bf16 under amp): the [M, V] logits stay in it (every [M, V]
    pass is done in place), while the normaliser, the tail mass (summed directly, never as
    1 - Σ top) and the top-k terms are float32. Returns (loss [M], accept [M], drafter argmax
    [M]).
    """

    @staticmethod
    def forward(ctx, x, weight, ids, logp, dtype):
        xc, wc = x.to(dtype), weight.to(dtype)
        z = xc @ wc.T
        acc = torch.promote_types(dtype, torch.float32)
        zmax, top1 = z.max(-1)
        m = zmax.to(acc)[:, None]
        shifted = z.gather(1, ids).to(acc) - m
        tail = z.scatter(1, ids, float("-inf")).sub_(zmax[:, None]).exp_().sum(-1, dtype=acc)
        total = tail + shifted.exp().sum(-1)
        log_q_top = shifted - total.log()[:, None]  # in log space: exp underflow gives no -inf
        q_tail = (tail / total).clamp(min=1e-6)
        p_top = logp.to(acc).exp()
        p_tail = (1 - p_top.sum(-1)).clamp(min=0)
        loss = -(p_top * log_q_top).sum(-1) - p_tail * q_tail.log()
        q_top = log_q_top.exp()
        accept = torch.minimum(p_top, q_top).sum(-1) + torch.minimum(p_tail, q_tail)
        ctx.save_for_backward(xc, wc, z, zmax, total, ids, p_top, q_top, p_tail, q_tail)
        ctx.weight_dtype, ctx.x_dtype = weight.dtype, x.dtype
        ctx.mark_non_differentiable(top1)
        return loss, accept, top1

    @staticmethod
    def backward(ctx, g_loss, g_accept, _g_top1):
        xc, wc, z, zmax, total, ids, p_top, q_top, p_tail, q_tail = ctx.saved_tensors
        scale = g_loss * (1 - p_tail / q_tail)
        top = g_loss[:, None] * (q_top - p_top)
        if g_accept is not None:
            below_top = (q_top < p_top).to(q_top.dtype)
            below_tail = (q_tail < p_tail).to(q_top.dtype)
            c_mass = (q_top * below_top).sum(-1) + q_tail * below_tail
            scale = scale + g_accept * (below_tail - c_mass)
            top = top + g_accept[:, None] * q_top * (below_top - c_mass[:, None])
        g = z.sub(zmax[:, None]).exp_().mul_((scale / total)[:, None].to(z.dtype))  # q_j, rescaled
        g.scatter_(1, ids, top.to(g.dtype))
        grad_x = (g @ wc).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        grad_w = (g.T @ xc).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None, None


def head_factors(head: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, W) with head(h) = x W^T: the full head (x = h) or a low-rank one (x = W_down h)."""
    if hasattr(head, "w_up"):
        return F.linear(h, head.w_down), head.w_up
    if hasattr(head, "weight") and getattr(head, "kind", "full") == "full":
        return h, head.weight
    raise FlashSpecError(f"cannot train through a {type(head).__name__} head; use the full or a "
                         "low-rank head")


def entropy_parts(logp: torch.Tensor) -> torch.Tensor:
    """Entropy of the coarsened target (top-k + tail bucket), per row."""
    p = logp.exp()
    tail = (1 - p.sum(-1)).clamp(min=1e-12)
    return -(p * logp).sum(-1) - tail * tail.log()


def regression(out: torch.Tensor, feats: torch.Tensor, head: nn.Module, cfg: TrainConfig
               ) -> torch.Tensor:
    """Feature regression: SmoothL1, or the mean squared error of the full logit vectors
    (h - f)^T (W^T W / V) (h - f), which weighs feature directions by their effect on logits."""
    if cfg.reg == "smooth_l1":
        return F.smooth_l1_loss(out.float(), feats)
    x_h, weight = head_factors(head, out.float())
    x_f, _ = head_factors(head, feats)
    w = weight.float()
    diff = x_h - x_f
    return ((diff @ (w.T @ w / w.shape[0])) * diff).sum(-1).mean()


def losses(outs: list[torch.Tensor], batch: Batch, head: nn.Module, target: LlamaLM,
           cfg: TrainConfig, w_kl: float | None = None
           ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted loss over passes and its parts (kl_j, reg_j, acc_j = top-1 agreement) as
    detached 0-d tensors: reading them (a device sync) is left to the caller.

    With ``w_kl == 0`` under autograd the head is skipped (acc_j then comes from 64 rows).
    """
    w_kl = cfg.w_kl if w_kl is None else w_kl
    ids, logp = batch.rows(batch.top_ids, "region"), batch.rows(batch.top_logp, "region")
    skip = w_kl == 0 and torch.is_grad_enabled()
    if skip:
        ids, logp = ids[:64], logp[:64]
    dtype = torch.bfloat16 if cfg.amp == "bf16" else torch.float32
    entropy = entropy_parts(logp).mean().detach()
    feats = batch.rows(batch.feats, "valid")
    total, stats, norm = 0.0, {}, 0.0
    for j, out in enumerate(outs):
        rows = batch.rows(out, "region")
        rows = rows[:64].detach() if skip else rows
        x, weight = head_factors(head, rows)
        ce, accept, top1 = TailCrossEntropy.apply(x, weight, ids, logp, dtype)
        ce, accept = ce.mean(), accept.mean()
        reg = regression(batch.rows(out, "valid"), feats, head, cfg)
        w = cfg.unroll_decay ** j
        draft = 0.0 if skip else w_kl * ce + cfg.w_accept * (1 - accept)
        total = total + w * (draft + cfg.w_reg * reg)
        norm += w
        stats.update({f"kl_{j}": ce.detach() - entropy, f"reg_{j}": reg.detach(),
                      f"acc_{j}": (top1 == ids[:, 0]).float().mean(),
                      f"accept_{j}": accept.detach()})
    return total / norm, stats


def to_floats(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """0-d tensor stats (one device) as floats, with a single device-to-host read."""
    if not stats:
        return {}
    keys = list(stats)
    return dict(zip(keys, torch.stack([stats[k].detach().float().reshape(()) for k in keys]).tolist()))


# ---------------------------------------------------------------------- evaluation
def eval_prompts(tokenizer, per_dataset: int, datasets: Sequence[str] = ("humaneval", "gsm8k",
                                                                          "mtbench")) -> EvalSet:
    """The last ``per_dataset`` prompts of each eval split (first turn), as chat token ids.

    The tail is used so the first prompts of each eval split (what experiment=decode reports
    on by default) never steer checkpoint selection.
    """
    from flashspec.data import chat_ids, load_prompts
    prompts, ids = {}, {}
    for name in datasets:
        chosen = load_prompts(name, split="eval")[-per_dataset:] if per_dataset else []
        prompts[name] = [chat_ids(tokenizer, p.turns[:1], []) for p in chosen]
        ids[name] = [p.id for p in chosen]
    return EvalSet(prompts, ids)


def eval_tau(target: LlamaLM, module: EagleModule, head: nn.Module | None, evalset: EvalSet,
             gamma: int, new_tokens: int, eos: Sequence[int], temperature: float = 0.0
             ) -> dict[str, float]:
    """τ (tokens per target forward) of speculative decoding per dataset, and 'mean': greedy,
    or sampled at ``temperature`` from a fixed seed (every evaluation draws the same streams)."""
    from flashspec.core import Arm, SamplingParams
    from flashspec.engine import SpecEngine
    if next(module.parameters()).dtype != target.dtype:
        module = copy.deepcopy(module).to(target.dtype)
        head = copy.deepcopy(head).to(target.dtype) if head is not None else None
    drafter = EagleDrafter(target, module, head)
    engine = SpecEngine(target, [Arm(drafter.name, gamma)], eos_ids=eos, drafters=[drafter],
                        params=SamplingParams(temperature=temperature))
    out = {}
    for name, prompts in evalset.prompts.items():
        if prompts:
            rows = engine.generate(prompts, new_tokens, seed=0).rows
            steps = sum(r.steps for r in rows)
            out[name] = (sum(r.n_accepted for r in rows) + steps) / max(steps, 1)
    out["mean"] = sum(out.values()) / max(len(out), 1)
    return out


@torch.no_grad()
def validate(module: EagleModule, head: nn.Module, target: LlamaLM, data: Store,
             val: Sequence[int], cfg: TrainConfig, autocast: Callable) -> dict[str, float]:
    """Mean loss parts over the held-out sequences."""
    sums: dict[str, torch.Tensor] = {}
    groups = batches(data, val, cfg, random.Random(0))
    for idx in groups:
        batch = collate(data, idx, cfg)
        with autocast():
            _, stats = losses(forward_passes(module, target, batch, cfg), batch, head, target, cfg)
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + v / len(groups)
    return to_floats(sums)


# ---------------------------------------------------------------------- the loop
@dataclass
class TrainResult:
    module: EagleModule
    head: nn.Module | None
    steps: int
    best_step: int
    best_tau: float | None
    history: list[dict[str, Any]]
    wall_s: float
    paused: bool = False    # stopped at a call's limit with its state saved (not finished)


STATE_FORMAT = "flashspec-train-state-v1"


@dataclass
class Resumable:
    """Where a run keeps its state and when this call stops: the state file ``path`` is written
    every ``every`` steps (0: only when pausing) and when the call pauses, at ``stop_at``
    (time.time()) or after training ``call_steps`` steps; with ``resume`` a call continues from the state in
    ``path`` (a fresh start when there is none). ``fingerprint`` names what the state must have
    been trained on (data and config): a state of anything else is refused, never continued."""

    path: Path
    every: int = 0
    stop_at: float | None = None
    call_steps: int | None = None
    resume: bool = True
    fingerprint: str = ""

    def load(self, cfg: TrainConfig) -> dict[str, Any] | None:
        """The saved state to continue from, or None (no file, or ``resume`` off)."""
        if not self.resume or not Path(self.path).is_file():
            return None
        state = torch.load(self.path, map_location="cpu", weights_only=False)
        if state.get("format") != STATE_FORMAT:
            raise FlashSpecError(f"{self.path} is not a training state ({state.get('format')!r})")
        if state["fingerprint"] != self.fingerprint or state["config"] != asdict(cfg):
            diff = sorted(k for k, v in asdict(cfg).items() if state["config"].get(k) != v)
            raise FlashSpecError(
                f"{self.path} holds a run of other data or settings (differing train keys: "
                f"{diff or 'none; the data differs'}); continue it with its own settings, or "
                "set experiment.resume=false to start over")
        return state

    def save(self, state: dict[str, Any]) -> None:
        """Write the state atomically (a call killed while writing leaves the previous one)."""
        path = Path(self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_sibling(path)
        torch.save({"format": STATE_FORMAT, "fingerprint": self.fingerprint, **state}, tmp)
        os.replace(tmp, path)


def lr_at(step: int, elapsed: float, cfg: TrainConfig) -> float:
    """Linear warmup then cosine decay over steps (or the time budget, whichever is nearer)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = step / cfg.steps
    if cfg.time_budget_s:
        frac = max(frac, elapsed / cfg.time_budget_s)
    frac = min(frac, 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def train(target: LlamaLM, data: DistillData | Store, cfg: TrainConfig,
          head: nn.Module | None = None,
          evalset: EvalSet | None = None, eos: Sequence[int] = (),
          log_fn: Callable[[dict[str, Any], int], None] | None = None,
          on_best: Callable[[EagleModule, nn.Module | None, dict[str, Any]], None] | None = None,
          progress: bool = True, resumable: Resumable | None = None) -> TrainResult:
    """Train a drafter on ``data``; evaluates τ every ``eval_every`` steps and at the end (greedy,
    or sampled at ``eval_temperature``).

    ``head``: the drafter's head (default the target's frozen one); its trainable parameters
    are trained too. ``on_best(module, head, record)`` fires on every new best held-out τ.
    The data is moved to the target's device once; the loop reads the device (a sync) only
    every ``log_every`` steps and at evaluations. ``resumable``: continue from a saved state,
    save it as it goes, and pause (``TrainResult.paused``, no final evaluation) at the call's
    limit.
    """
    torch.manual_seed(cfg.seed)
    dev_type = torch.device(target.device).type
    if dev_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    data = data if isinstance(data, Store) else to_store(data, target.device)
    module = build_module(target, cfg, head)
    head_module = head if head is not None else target.lm_head
    params = [p for p in module.parameters()] + [p for p in head_module.parameters() if p.requires_grad]
    fused = dev_type == "cuda" and all(p.dtype == torch.float32 and p.is_cuda for p in params)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                            fused=fused or None)
    train_idx, val_idx = split_val(data, cfg.val_fraction, cfg.seed)
    if not train_idx:
        raise FlashSpecError("no training sequences left after the validation split")
    autocast = lambda: torch.autocast(dev_type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16")
    rng, gen = random.Random(cfg.seed), torch.Generator().manual_seed(cfg.seed)
    queue: list[list[int]] = []
    history: list[dict[str, Any]] = []
    best_tau, best_step = None, -1
    t0, running = time.perf_counter(), {}
    trained_head = head is not None and any(p.requires_grad for p in head.parameters())
    start = 0
    state = resumable.load(cfg) if resumable is not None else None
    if state is not None:
        module.load_state_dict(state["module"])
        if trained_head:
            head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        rng.setstate(state["rng"])
        gen.set_state(state["gen"])
        torch.set_rng_state(state["torch_rng"])
        if dev_type == "cuda" and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], torch.device(target.device))
        queue, history, running = state["queue"], state["history"], state["running"]
        best_tau, best_step, start = state["best_tau"], state["best_step"], state["step"]
        t0 -= state["train_s"]   # elapsed time (a time-budgeted schedule) continues too
        log.info("resuming %s at step %d of %d", resumable.path, start, cfg.steps)

    def save_state(step: int) -> None:
        resumable.save({
            "step": step, "config": asdict(cfg), "module": module.state_dict(),
            "head": head.state_dict() if trained_head else None, "opt": opt.state_dict(),
            "rng": rng.getstate(), "gen": gen.get_state(), "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(torch.device(target.device))
            if dev_type == "cuda" else None,
            "queue": queue, "history": history, "running": running, "best_tau": best_tau,
            "best_step": best_step, "train_s": time.perf_counter() - t0})

    def evaluate(step: int) -> None:
        nonlocal best_tau, best_step
        module.eval()
        rec: dict[str, Any] = {"step": step, "train_s": time.perf_counter() - t0}
        if val_idx:
            rec.update({f"val/{k}": v for k, v in
                        validate(module, head_module, target, data, val_idx, cfg, autocast).items()})
        if evalset is not None:
            taus = eval_tau(target, module, head, evalset, cfg.eval_gamma, cfg.eval_new_tokens, eos,
                            cfg.eval_temperature)
            rec.update({f"eval/tau_{k}": v for k, v in taus.items()})
            if best_tau is None or taus["mean"] > best_tau:
                best_tau, best_step = taus["mean"], step
                if on_best is not None:
                    on_best(module, head, rec)
        module.train()
        history.append(rec)
        if log_fn is not None:
            log_fn(rec, step)
        log.info("step %d: %s", step, {k: round(v, 4) for k, v in rec.items() if isinstance(v, float)})

    warm = cfg.init.startswith("checkpoint:") and evalset is not None
    bar = tqdm(total=cfg.steps, initial=start, desc="train eagle", unit="step",
               disable=not progress)
    module.train()
    step = start
    for step in range(start, cfg.steps):
        elapsed = time.perf_counter() - t0
        if cfg.time_budget_s and elapsed > cfg.time_budget_s:
            log.info("time budget %.0fs reached at step %d", cfg.time_budget_s, step)
            break
        if resumable is not None and step > start:
            if (resumable.call_steps is not None and step >= start + resumable.call_steps) or \
                    (resumable.stop_at is not None and time.time() >= resumable.stop_at):
                save_state(step)
                bar.close()
                log.info("paused at step %d of %d: state in %s (resume to continue)", step,
                         cfg.steps, resumable.path)
                module.eval()
                return TrainResult(module, head, step, best_step, best_tau, history,
                                   time.perf_counter() - t0, paused=True)
            if resumable.every and step % resumable.every == 0:
                save_state(step)
        if cfg.eval_every and step % cfg.eval_every == 0 and (step or warm):
            evaluate(step)   # step 0 of a warm start: the drafter it starts from, as a baseline
        if not queue:
            queue = batches(data, train_idx, cfg, rng)
        batch = collate(data, queue.pop(), cfg)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, elapsed, cfg)
        with autocast():
            depth = cfg.unroll if step >= cfg.unroll_from_step else 1
            outs = forward_passes(module, target, batch, cfg, gen, depth)
            loss, stats = losses(outs, batch, head_module, target, cfg,
                                 cfg.w_kl if step >= cfg.kl_from_step else 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        bar.update()
        if step % cfg.log_every and step + 1 < cfg.steps:
            continue
        values = to_floats({**stats, "loss": loss.detach(), "grad_norm": gnorm})
        if not math.isfinite(values["loss"]):
            raise FloatingPointError(f"non-finite training loss at step {step}; lower the lr")
        values["lr"] = opt.param_groups[0]["lr"]
        for k, v in values.items():
            running[k] = 0.5 * running.get(k, v) + 0.5 * v
        if log_fn is not None:
            log_fn({f"train/{k}": v for k, v in values.items()}, step)
        bar.set_postfix(loss=f"{running['loss']:.3f}", acc0=f"{running['acc_0']:.3f}")
    else:
        step = cfg.steps
    bar.close()
    evaluate(step)
    module.eval()
    return TrainResult(module, head, step, best_step, best_tau, history, time.perf_counter() - t0)
