"""Train a low-rank head for a feature-level (EAGLE-style) drafter, and cache it.

Data: the target's greedy continuations of ``train``-split prompts; one cache-free target
forward over each (prompt + continuation) gives its final-normed features f_p; the drafter
module, teacher-forced for one step (slot s reads (f_{s-1}, x_s)), gives the predicted feature
ĥ_s that its head sees while drafting. Rows are the response positions (each predicts the next
continuation token). Teacher: the target's next-token distribution there, ``softmax(W f_s)``
(temperature 1), computed from the stored f_s, so the KL is exact over the full vocabulary.

The head starts from an (activation-aware) SVD of the full head ``W`` and is distilled with
:func:`flashspec.heads.distill.distill_lowrank`. Held-out agreement (top-1 with the target, KL,
acceptance at T=1) is measured on ``eval``-split prompts and stored with the head.

Caches (``cache_root``, e.g. ``.cache/heads``): the collected (ĥ, f) rows under ``data/``,
keyed by (drafter checkpoint content, target weights, data spec); the trained head keyed by
that data key, the rank and the training settings.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from safetensors.torch import load_file, save_file

from flashspec.errors import FlashSpecError
from flashspec.paths import file_sha256, temp_sibling, write_text_atomic
from flashspec.heads.choice import HeadChoice, LowRankChoice, resolve_rank
from flashspec.heads.distill import agreement_metrics, check_disjoint, distill_lowrank
from flashspec.heads.hidden import greedy_generate
from flashspec.heads.io import load_head, save_head
from flashspec.heads.modules import FullHead, Head, LowRankHead

log = logging.getLogger(__name__)
FORMAT = "flashspec-eagle-head-data-v1"
GEN_BATCH = 16   # prompts per greedy-generation batch


@dataclass(frozen=True)
class HeadTrainSpec:
    """Data and optimisation of a head trained on first use (small enough for a laptop CPU)."""

    dataset: str = "mixed"          # prompt stream of flashspec.data (train / eval splits)
    n_train: int = 32               # train-split prompts (greedy continuations of the target)
    n_eval: int = 8                 # eval-split prompts for the held-out agreement report
    max_new_tokens: int = 96
    steps: int = 200
    lr: float = 3e-3
    batch_size: int = 256
    init: str = "asvd"              # asvd (calibrated on the train ĥ) | svd
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.n_train, self.n_eval, self.max_new_tokens, self.steps, self.batch_size) < 1:
            raise FlashSpecError(f"head training needs positive sizes, got {self}")
        if self.init not in ("svd", "asvd"):
            raise FlashSpecError(f"head training init={self.init!r}; choose svd or asvd")

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> "HeadTrainSpec":
        """From a config mapping (``head_training: {steps: 500}``); unknown keys are refused."""
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        extra = sorted(set(options) - known)
        if extra:
            raise FlashSpecError(f"head_training has unknown keys {extra}; known: {sorted(known)}")
        return cls(**options)

    def data_spec(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("dataset", "n_train", "n_eval", "max_new_tokens",
                                              "seed")}

    def train_spec(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("steps", "lr", "batch_size", "init", "seed")}


# ---------------------------------------------------------------------- keys
@torch.no_grad()
def target_fingerprint(target: Any, stride: int = 4099) -> str:
    """A cheap hash of the target's weights (every ``stride``-th value of each tensor, its
    name, shape and dtype): different weights or numerics give different teacher data."""
    h = hashlib.sha256()
    for name, t in sorted(target.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        if t.is_floating_point() and t.numel():
            h.update(t.detach().flatten()[::stride].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def data_key(drafter_sha: str, target_fp: str, spec: HeadTrainSpec) -> str:
    """Key of the collected rows: drafter checkpoint content, target weights, data spec."""
    return _digest({"format": FORMAT, "drafter": drafter_sha, "target": target_fp,
                    "data": spec.data_spec()})


def head_key(drafter_sha: str, target_fp: str, rank: int, spec: HeadTrainSpec) -> str:
    """Key of a trained head: its data key, its rank and the training settings."""
    return _digest({"data": data_key(drafter_sha, target_fp, spec), "rank": int(rank),
                    "train": spec.train_spec()})


def cached_head_path(cache_root: str | Path, drafter: str, rank: int, key: str) -> Path:
    return Path(cache_root) / f"{drafter}_r{rank}_{key}.safetensors"


# ---------------------------------------------------------------------- data
@dataclass
class EagleHeadData:
    """Aligned rows: drafter feature ĥ [N, d] (what its head sees), target feature f [N, d]
    (the teacher is ``W f``), and the prompt ids the rows came from."""

    drafter: torch.Tensor
    target: torch.Tensor
    prompt_ids: list[str]

    def __len__(self) -> int:
        return self.drafter.shape[0]


def split_prompts(tokenizer: Any, spec: HeadTrainSpec, split: str) -> tuple[list[str], list[list[int]]]:
    """(ids, first-turn chat token ids) of ``spec``'s prompts of one split."""
    from flashspec.data import chat_ids, load_prompts
    n = spec.n_train if split == "train" else spec.n_eval
    prompts = load_prompts(spec.dataset, n=n, seed=spec.seed, split=split)
    return [p.id for p in prompts], [chat_ids(tokenizer, p.turns[:1], []) for p in prompts]


@torch.inference_mode()
def eagle_rows(target: Any, module: Any, prompts: Sequence[Sequence[int]],
               continuations: Sequence[Sequence[int]], batch_size: int = 8,
               progress: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(ĥ, f) float32 on CPU at the response positions of each (prompt, continuation).

    One step teacher-forced: slot s of the module reads (f_{s-1}, x_s), exactly as slot s
    does while drafting from a committed prefix."""
    from tqdm.auto import tqdm
    from flashspec.models.llama import LlamaLM
    seqs = [([*p, *c], len(p), len(c)) for p, c in zip(prompts, continuations)]
    h_rows, f_rows = [], []
    for start in tqdm(range(0, len(seqs), batch_size), desc="drafter features",
                      disable=not progress):
        chunk = seqs[start:start + batch_size]
        width = max(len(s) for s, _, _ in chunk)
        tokens = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, (s, _, _) in enumerate(chunk):
            tokens[i, :len(s)] = torch.tensor(s)
        tokens = tokens.to(target.device)
        pos = torch.arange(width, device=target.device)[None].expand(len(chunk), -1)
        f = target.forward_hidden(tokens, pos)           # right padding: causal mask keeps it out
        prev = torch.cat([torch.zeros_like(f[:, :1]), f[:, :-1]], dim=1)
        mask = LlamaLM.attention_mask(pos, width, False)
        h = module(prev, target.embed_tokens(tokens), target.rope(pos), pos, mask)
        for i, (_, n_prompt, n_cont) in enumerate(chunk):
            lo, hi = n_prompt - 1, n_prompt + n_cont - 1   # row j predicts continuation token j
            h_rows.append(h[i, lo:hi].float().cpu())
            f_rows.append(f[i, lo:hi].float().cpu())
    return torch.cat(h_rows), torch.cat(f_rows)


def collect(target: Any, tokenizer: Any, module: Any, spec: HeadTrainSpec, split: str,
            progress: bool = True) -> EagleHeadData:
    """Rows of one split: the target's greedy continuations, then (ĥ, f) at each position."""
    ids, prompts = split_prompts(tokenizer, spec, split)
    eos = tokenizer.eos_token_id
    conts = greedy_generate(target, prompts, spec.max_new_tokens, eos, batch_size=GEN_BATCH,
                            progress=progress)
    keep = [i for i, c in enumerate(conts) if c]
    h, f = eagle_rows(target, module, [prompts[i] for i in keep], [conts[i] for i in keep],
                      progress=progress)
    return EagleHeadData(h, f, [ids[i] for i in keep])


def load_or_collect(target: Any, tokenizer: Any, module: Any, spec: HeadTrainSpec,
                    folder: Path, progress: bool = True) -> tuple[EagleHeadData, EagleHeadData]:
    """(train rows, eval rows), cached as ``folder/data.safetensors`` (+ meta.json)."""
    path = folder / "data.safetensors"
    if path.is_file():
        t = load_file(str(path))
        meta = json.loads((folder / "meta.json").read_text())
        return (EagleHeadData(t["train_h"].float(), t["train_f"].float(), meta["train_prompt_ids"]),
                EagleHeadData(t["eval_h"].float(), t["eval_f"].float(), meta["eval_prompt_ids"]))
    train = collect(target, tokenizer, module, spec, "train", progress)
    evals = collect(target, tokenizer, module, spec, "eval", progress)
    check_disjoint(train.prompt_ids, evals.prompt_ids)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    save_file({"train_h": train.drafter.half(), "train_f": train.target.half(),
               "eval_h": evals.drafter.half(), "eval_f": evals.target.half()}, str(tmp))
    write_text_atomic(folder / "meta.json", json.dumps({
        "format": FORMAT, "spec": spec.data_spec(), "train_prompt_ids": train.prompt_ids,
        "eval_prompt_ids": evals.prompt_ids, "train_rows": len(train), "eval_rows": len(evals)},
        indent=1) + "\n")
    os.replace(tmp, path)
    # fp16 on disk: the same values whether just collected or read back
    load = lambda d: EagleHeadData(d.drafter.half().float(), d.target.half().float(), d.prompt_ids)
    return load(train), load(evals)


# ---------------------------------------------------------------------- training
def train_lowrank(target: Any, rank: int, train: EagleHeadData, evals: EagleHeadData,
                  spec: HeadTrainSpec, progress: bool = True) -> tuple[LowRankHead, dict[str, Any]]:
    """A rank-``rank`` head distilled to the target's distribution; (head, held-out metrics)."""
    weight = target.lm_head_weight.detach().float().cpu()
    full = FullHead(weight)
    teacher = lambda f: full(f)      # W f: the target's logits at that position
    calib = train.drafter if spec.init == "asvd" else None
    head = LowRankHead.from_svd(weight, rank, calib)
    before = agreement_metrics(head, evals.drafter, full, teacher, evals.target)
    distill_lowrank(head, train.drafter, teacher, spec.steps, lr=spec.lr,
                    batch_size=spec.batch_size, teacher_inputs=train.target,
                    train_prompt_ids=train.prompt_ids, eval_prompt_ids=evals.prompt_ids,
                    seed=spec.seed, progress=progress, teacher_name="target_distribution",
                    data_description=f"{spec.dataset} train split, target greedy continuations "
                                     f"(max_new={spec.max_new_tokens}), eagle one-step features")
    after = agreement_metrics(head, evals.drafter, full, teacher, evals.target)
    reference = agreement_metrics(full, evals.drafter, full, teacher, evals.target)
    metrics = {"eval_rows": len(evals), "train_rows": len(train),
               f"{spec.init}_init": _short(before), "trained": _short(after),
               "full_head": _short(reference)}
    return head.requires_grad_(False), metrics


def _short(m: Mapping[str, Any]) -> dict[str, Any]:
    keep = ("kl_full", "top1_full", "top1_target", "accept_t1")
    return {k: round(float(m[k]), 4) for k in keep if m.get(k) is not None}


@torch.no_grad()
def estimate_seconds(target: Any, module: Any, rank: int, spec: HeadTrainSpec,
                     data_cached: bool) -> float:
    """Rough wall time of :func:`train_lowrank` (+ data collection unless cached), from two
    short probes on this machine: one distillation step and one greedy decode step."""
    from flashspec.heads.distill import kl_rows
    d = target.shape.hidden_size
    weight = target.lm_head_weight.detach().float().cpu()
    h = torch.randn(spec.batch_size, d)
    head = LowRankHead(torch.randn(rank, d) * 0.02, torch.randn(weight.shape[0], rank) * 0.02)
    t0 = time.perf_counter()
    with torch.enable_grad():
        kl_rows(h @ weight.T, head(h)).mean().backward()
    step = time.perf_counter() - t0
    total = spec.steps * step * 1.1
    if not data_cached:
        n = spec.n_train + spec.n_eval
        batch = min(GEN_BATCH, n)
        ids = torch.zeros(batch, 1, dtype=torch.long, device=target.device)
        cache = target.new_cache(batch, 4)
        pos = torch.zeros(batch, 1, dtype=torch.long, device=target.device)
        t0 = time.perf_counter()
        for i in range(2):
            target(ids, pos + i, cache, span=i + 1)
        decode = (time.perf_counter() - t0) / 2
        total += -(-n // batch) * spec.max_new_tokens * decode * 1.3   # + prefill and features
    return total


def load_or_train(target: Any, tokenizer: Any, module: Any, rank: int, drafter: str,
                  checkpoint: str | Path, cache_root: str | Path,
                  spec: HeadTrainSpec = HeadTrainSpec(), progress: bool = True) -> LowRankHead:
    """The cached rank-``rank`` head of this drafter, trained (and cached) on a miss."""
    if tokenizer is None:
        raise FlashSpecError(f"training a head for drafter {drafter!r} needs the target's "
                             "tokenizer (DraftContext.tokenizer)")
    cache_root = Path(cache_root)
    drafter_sha, target_fp = file_sha256(checkpoint), target_fingerprint(target)
    key = head_key(drafter_sha, target_fp, rank, spec)
    path = cached_head_path(cache_root, Path(checkpoint).stem, rank, key)
    if path.is_file():
        log.info("rank-%d head for drafter %s: cached at %s", rank, drafter, path)
        return load_head(path)[0]
    dkey = data_key(drafter_sha, target_fp, spec)
    folder = cache_root / "data" / dkey
    eta = estimate_seconds(target, module, rank, spec, (folder / "data.safetensors").is_file())
    log.warning("training a rank-%d head for drafter %s: about %.0f s on this machine "
                "(%d train prompts x %d tokens, %d steps); cached at %s", rank, drafter, eta,
                spec.n_train, spec.max_new_tokens, spec.steps, path)
    t0 = time.perf_counter()
    train, evals = load_or_collect(target, tokenizer, module, spec, folder, progress)
    t_data = time.perf_counter() - t0
    head, metrics = train_lowrank(target, rank, train, evals, spec, progress)
    wall = time.perf_counter() - t0
    from flashspec.records import git_commit
    save_head(head.half(), path, {
        "commit": git_commit(), "drafter": drafter, "drafter_checkpoint": str(checkpoint),
        "drafter_sha256": drafter_sha, "target_fingerprint": target_fp, "data_key": dkey,
        "head_key": key, "spec": asdict(spec), "metrics": metrics,
        "train_s": round(wall, 1), "data_s": round(t_data, 1), "estimated_s": round(eta, 1)})
    log.warning("trained rank-%d head for drafter %s in %.0f s (held-out top-1 vs target %.3f, "
                "full head %.3f) -> %s", rank, drafter, wall,
                metrics["trained"].get("top1_target", float("nan")),
                metrics["full_head"].get("top1_target", float("nan")), path)
    return load_head(path)[0]


# ---------------------------------------------------------------------- lookup
def load_shipped(path: str | Path, rank: int, drafter: str, drafter_sha: str) -> Head:
    """A shipped head file of this drafter; refused when it was trained for another
    checkpoint (its ``drafter_sha256``) or has another rank."""
    head, meta = load_head(path)
    if not isinstance(head, LowRankHead) or head.rank != rank:
        raise FlashSpecError(f"{path} holds a {meta.get('kind')} head of rank {meta.get('rank')}, "
                             f"listed as rank {rank} for drafter {drafter!r}; fix its heads: entry")
    if meta.get("drafter_sha256") not in (None, drafter_sha):
        raise FlashSpecError(f"{path} was trained for another {drafter!r} checkpoint (sha256 "
                             f"{str(meta.get('drafter_sha256'))[:12]}..., this one {drafter_sha[:12]}"
                             "...); retrain it or drop it from the drafter's heads: entry")
    return head


def trained_heads(choice: HeadChoice, target: Any, tokenizer: Any, module: Any, drafter: str,
                  checkpoint: str | Path, baked: Head | None = None,
                  shipped: Mapping[int | str, str | Path] | None = None,
                  cache_root: str | Path | None = None,
                  training: HeadTrainSpec = HeadTrainSpec(), progress: bool = True
                  ) -> dict[int, Head]:
    """The trained low-rank heads (rank -> head) that ``choice.build`` may take.

    Only the rank the choice asks for is loaded or trained (``head=lowrank head.init=trained``
    without ``head.checkpoint``), in this order: the head ``baked`` into the drafter's
    checkpoint, the ``shipped`` head files (rank as int or 'd/N' -> path), the head cache under
    ``cache_root``, and last a head trained now and cached there. ``cache_root`` None never
    trains: a missing rank is then the choice's clear error, listing the ranks there are."""
    from flashspec.paths import repo_path
    hidden = target.shape.hidden_size
    known: dict[int, Head] = {baked.rank: baked} if isinstance(baked, LowRankHead) else {}
    if not (isinstance(choice, LowRankChoice) and choice.init == "trained" and not choice.checkpoint):
        return known
    rank = resolve_rank(choice.rank, hidden)
    files = {resolve_rank(r, hidden): repo_path(p) for r, p in (shipped or {}).items()}
    if rank in known:
        return known
    if rank in files or cache_root is None:
        sha = file_sha256(repo_path(checkpoint))
        for r, p in files.items():
            if r == rank or cache_root is None:
                known[r] = load_shipped(p, r, drafter, sha)
        return known
    known[rank] = load_or_train(target, tokenizer, module, rank, drafter, repo_path(checkpoint),
                                repo_path(cache_root), training, progress)
    return known
