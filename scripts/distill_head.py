"""Training-free vs distilled low-rank heads of a SmolLM2 layer-skip drafter, on held-out prompts.

Pipeline (all on the real model through ``flashspec.models``):
1. train / eval prompts from the fixed, disjoint splits of ``flashspec.data``;
2. the target's greedy continuations of both (cached in .cache/heads/);
3. token frequencies of the train continuations -> truncated-head baseline (saved);
4. drafter hidden states (first-k layers + final norm) and the target's final hidden states;
5. per rank: SVD init, activation-aware SVD init, KL distillation (teacher: the drafter's full
   head, or the target's distribution), and the equal-cost truncated head; metrics on the
   held-out prompts; heads saved as safetensors with provenance.

    python scripts/distill_head.py --first 10 --ranks d/4 d/8 d/16 d/32 --steps 300
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

from flashspec.data import chat_ids, load_prompts
from flashspec.heads import (FullHead, LowRankHead, TruncatedHead, agreement_metrics,
                             check_disjoint, distill_lowrank, equal_cost_keep, resolve_rank,
                             save_frequencies, save_head, token_frequencies)
from flashspec.heads.hidden import HeadData, collect_states, greedy_generate
from flashspec.models import load_model
from flashspec.records import RecordWriter, git_commit, provenance


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dataset", default="mixed", help="humaneval | gsm8k | mtbench | mixed")
    p.add_argument("--first", type=int, default=10, help="layer-skip drafter = first k layers")
    p.add_argument("--ranks", nargs="+", default=["d/4", "d/8", "d/16", "d/32"])
    p.add_argument("--n-train", type=int, default=48)
    p.add_argument("--n-eval", type=int, default=24)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--teachers", nargs="+", default=["full", "target"],
                   choices=["full", "target"])
    p.add_argument("--target-ranks", nargs="+", default=["d/8"],
                   help="ranks also distilled on the target's distribution (teacher 'target')")
    p.add_argument("--distill-init", default="asvd", choices=["svd", "asvd"])
    p.add_argument("--skip-baselines", action="store_true",
                   help="only the distillation runs (no full / truncated / svd / asvd records)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (1 avoids stalls on a shared, busy CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "outputs/head_distill"))
    p.add_argument("--heads-dir", default=str(ROOT / "outputs/heads"))
    p.add_argument("--freqs-out", default=None, help="token-frequency file (default: in --out)")
    p.add_argument("--smoke", action="store_true", help="seconds: 2+2 prompts, 8 tokens, 3 steps")
    a = p.parse_args(argv)
    if a.smoke:
        a.n_train, a.n_eval, a.max_new, a.steps, a.ranks = 2, 2, 8, 3, a.ranks[:1]
    return a


def continuations(model: Any, tok: Any, prompts: list, ids: list[list[int]], max_new: int,
                  source: str) -> list[list[int]]:
    """Greedy target continuations, cached per (model, prompt id, max_new) in .cache/heads/."""
    path = ROOT / ".cache" / "heads" / f"greedy_{source}_max{max_new}.json"
    cache = json.loads(path.read_text()) if path.is_file() else {}
    todo = [i for i, p in enumerate(prompts) if p.id not in cache]
    if todo:
        gen = greedy_generate(model, [ids[i] for i in todo], max_new, tok.eos_token_id)
        cache.update({prompts[i].id: g for i, g in zip(todo, gen)})
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cache))
    return [cache[p.id] for p in prompts]


def prepare(a: argparse.Namespace, model: Any, tok: Any) -> tuple[HeadData, HeadData, list, list]:
    """(train data, eval data, train continuations, eval continuations)."""
    train = load_prompts(a.dataset, n=a.n_train, seed=a.seed, split="train")
    evals = load_prompts(a.dataset, n=a.n_eval, seed=a.seed, split="eval")
    check_disjoint([p.id for p in train], [p.id for p in evals])
    out = []
    for prompts in (train, evals):
        ids = [chat_ids(tok, p.turns[:1], []) for p in prompts]
        conts = continuations(model, tok, prompts, ids, a.max_new, a.model)
        data = collect_states(model, ids, conts, range(a.first), [p.id for p in prompts])
        out.append((data, conts))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    t0 = time.time()
    model, tok = load_model(a.model)
    weight = model.lm_head_weight.detach()
    vocab, d = weight.shape
    train, evals, train_conts, _ = prepare(a, model, tok)
    print(f"data: {len(train)} train rows, {len(evals)} eval rows ({time.time() - t0:.0f}s)")
    freqs = token_frequencies(train_conts, vocab)
    suffix = "_smoke" if a.smoke else ""
    freq_path = Path(a.freqs_out or Path(a.out) / f"{a.model}_token_freqs{suffix}.safetensors")
    common = {"model": a.model, "drafter": f"skip{a.first}", "drafter_layers": a.first,
              "dataset": a.dataset, "max_new": a.max_new, "train_prompt_ids": train.prompt_ids,
              "eval_prompt_ids": evals.prompt_ids, "n_train_rows": len(train),
              "n_eval_rows": len(evals)}
    if not a.skip_baselines:
        save_frequencies(freqs, freq_path, {"text": "target greedy continuations of train "
                                            "prompts", "commit": git_commit(), **common})
    full = FullHead(weight)
    writer = RecordWriter(Path(a.out) / f"distill_{a.model}_skip{a.first}{suffix}.jsonl")
    prov = provenance(vars(a), a.seed)

    def emit(head: torch.nn.Module, **fields: Any) -> dict:
        m = agreement_metrics(head, evals.drafter, full, full, evals.target)
        rec = {"experiment": "head_distill", **fields, **m, "weight_bytes": head.weight_bytes(),
               "cost_ratio": head.weight_bytes() / full.weight_bytes(), **common, "provenance": prov}
        writer.write(rec)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()
               if k in ("kind", "init", "teacher", "rank", "keep", "kl_full", "full_mass_kept",
                        "top1_full", "top1_target", "accept_t1")})
        return rec

    if not a.skip_baselines:
        emit(full, kind="full", init=None, teacher=None, rank=None, keep=None)
    tables: dict = {}
    for spec in a.ranks:
        rank = resolve_rank(spec, d)
        base = {"rank": rank, "rank_spec": spec}
        if not a.skip_baselines:
            baselines(a, weight, freqs, train, tok.eos_token_id, emit, base)
        for teacher in a.teachers:
            if teacher == "target" and spec not in a.target_ranks and not a.smoke:
                continue
            distill(a, weight, train, evals, full, teacher, emit, base, tables)
    print(f"done in {time.time() - t0:.0f}s -> {writer.path}")
    return 0


@torch.no_grad()
def logits_table(head: Any, inputs: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    """Teacher logits [N, V] computed once (distillation then reads rows instead of re-running
    the V x d teacher head every step)."""
    return torch.cat([head(inputs[i:i + batch_size]) for i in range(0, inputs.shape[0], batch_size)])


def baselines(a: argparse.Namespace, weight: torch.Tensor, freqs: torch.Tensor, train: HeadData,
              eos_id: int, emit: Any, base: dict) -> None:
    """Equal-cost truncation and the two training-free low-rank inits (asvd saved as a head)."""
    vocab, d = weight.shape
    rank = base["rank"]
    keep = equal_cost_keep(rank, vocab, d)
    emit(TruncatedHead.from_frequencies(weight, freqs, keep, [eos_id]), kind="truncated",
         init="frequencies", teacher=None, rank=None, keep=keep, rank_spec=base["rank_spec"])
    emit(LowRankHead.from_svd(weight, rank), kind="lowrank", init="svd", teacher=None, keep=None,
         **base)
    asvd = LowRankHead.from_svd(weight, rank, train.drafter)
    path = Path(a.heads_dir) / f"{a.model}_skip{a.first}_r{rank}_asvd.safetensors"
    save_head(asvd, path, {"commit": git_commit(), "model": a.model, "init": "asvd",
                           "drafter_layers": a.first, "calibration": "train hidden states",
                           "train_prompt_ids": train.prompt_ids})
    emit(asvd, kind="lowrank", init="asvd", teacher=None, keep=None, checkpoint=str(path), **base)


def distill(a: argparse.Namespace, weight: torch.Tensor, train: HeadData, evals: HeadData,
            full: FullHead, teacher: str, emit: Any, base: dict, tables: dict) -> None:
    """Distil one rank from the training-free init; record metrics, curve and the saved head.

    Teacher 'full': the drafter's full head on the drafter's hidden states; 'target': the
    target's distribution (its head, tied to the drafter's here, on the target's states).
    """
    rank = base["rank"]
    head = LowRankHead.from_svd(weight, rank, train.drafter if a.distill_init == "asvd" else None)
    if teacher not in tables:
        src_train, src_eval = ((train.drafter, evals.drafter) if teacher == "full"
                               else (train.target, evals.target))
        tables.clear()  # keep one teacher's tables in memory at a time
        tables[teacher] = (logits_table(full, src_train), logits_table(full, src_eval))
    t_train, t_eval = tables[teacher]
    curve = distill_lowrank(head, train.drafter, lambda z: z, a.steps, lr=a.lr,
                            temperature=a.temperature, batch_size=a.batch_size,
                            teacher_inputs=t_train, eval_hidden=evals.drafter,
                            eval_teacher_inputs=t_eval, eval_every=max(1, a.steps // 5),
                            train_prompt_ids=train.prompt_ids, eval_prompt_ids=evals.prompt_ids,
                            seed=a.seed, teacher_name=f"{teacher}_distribution",
                            data_description=f"{a.dataset} train split, target greedy "
                                             f"continuations (max_new={a.max_new}), "
                                             f"skip{a.first} hidden states")
    path = Path(a.heads_dir) / f"{a.model}_skip{a.first}_r{rank}_{teacher}.safetensors"
    save_head(head, path, {"commit": git_commit(), "model": a.model, "drafter_layers": a.first})
    points = [c for c in curve if "eval_kl" in c]
    emit(head, kind="lowrank", init=f"distilled_from_{a.distill_init}", teacher=teacher,
         keep=None, steps=a.steps, lr=a.lr, checkpoint=str(path), curve=points,
         final_train_loss=curve[-1]["loss"], **base)


if __name__ == "__main__":
    sys.exit(main())
