"""Offline prompt sets: HumanEval, GSM8K (test), MT-Bench, and a mixed-domain stream.

Files live in a local cache (``<repo>/.cache/data`` or ``$FLASHSPEC_DATA``) filled by
``python scripts/prepare_data.py``; they are read with ``datasets.load_dataset("json", ...)``.

Split rule (fixed, independent of ``seed``): inside each dataset and each category, prompts are
ranked by ``sha256("flashspec-split-v1:" + id)``; the first ``floor(TRAIN_FRACTION * size)`` of
that ranking are ``train`` (drafter/head training), all others are ``eval``. Eval is the larger
part and the two are disjoint: HumanEval 123/41, GSM8K 990/329, MT-Bench 64/16 (8 per category
in eval, 2 in train). ``split_ids(name, split)`` lists the ids.

Order: a split's prompts are shuffled per category with ``seed`` and then taken round-robin over
categories, so any prefix of ``n`` prompts is category-balanced (one per MT-Bench category for
n=8). ``mixed`` interleaves blocks of ``block_size`` prompts from its ``domains`` (default: code,
math, chat and code editing) in a seeded order with no two consecutive blocks from the same
domain: the non-stationary stream a drafter-selection bandit faces.

``codeedit`` is derived from HumanEval, no extra download: each task's reference solution, whole,
with an instruction to edit it (rename, annotate, validate, ...). The answer copies most of the
prompt, so prompt lookup drafts well there, unlike on the other domains: the stream's arms
really trade off. A codeedit prompt takes its HumanEval task's split, so drafters trained on the
train split never saw an eval prompt's function.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

from flashspec.errors import FlashSpecError
from flashspec.paths import file_sha256, repo_root

log = logging.getLogger(__name__)

DATASETS = ("humaneval", "gsm8k", "mtbench")
DERIVED = {"codeedit": "humaneval"}          # prompt set: the dataset whose file it is built from
STREAMS = DATASETS + tuple(DERIVED) + ("mixed",)
MIXED_DOMAINS = ("humaneval", "gsm8k", "mtbench", "codeedit")
SPLITS = ("eval", "train")
SOURCES = ("local", "hub")
FILES = {"humaneval": "humaneval.jsonl", "gsm8k": "gsm8k_test.jsonl",
         "mtbench": "mtbench_question.jsonl"}
EXPECTED_ROWS = {"humaneval": 164, "gsm8k": 1319, "mtbench": 80}
DOMAIN = {"humaneval": "code", "gsm8k": "math", "mtbench": "chat", "codeedit": "edit"}
HUB = {"humaneval": ("openai/openai_humaneval", None), "gsm8k": ("openai/gsm8k", "main")}
TRAIN_FRACTION = 0.25
PREPARE_HINT = "run `python scripts/prepare_data.py` (or scripts/setup.sh)"

HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the full function "
                         "in a Python code block.")
GSM8K_INSTRUCTION = "Solve the following math problem step by step, then give the final answer."
# Edits that leave most of the function as it is: the answer repeats the prompt's code.
CODE_EDITS = (
    "Add type hints to every parameter and local variable, changing nothing else.",
    "Rename the function to `{name}_v2` (and any call to itself); keep the body as it is.",
    "Add a short comment above each statement of the body; keep the code itself unchanged.",
    "Add input validation at the top of the body that raises ValueError on invalid arguments; "
    "keep the rest unchanged.",
    "Give the local variables more descriptive names, keeping the logic identical.",
    "Remove the docstring's examples and keep everything else exactly as it is.",
)

@dataclass(frozen=True)
class Prompt:
    """One prompt: user turns (MT-Bench has 2), its domain/category and optional reference."""

    id: str
    dataset: str
    domain: str
    category: str
    turns: list[str]
    reference: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.turns:
            raise FlashSpecError(f"prompt {self.id!r} has no turns")
        for i, turn in enumerate(self.turns):
            if not isinstance(turn, str) or not turn.strip():
                raise FlashSpecError(f"prompt {self.id!r} turn {i + 1} is empty; "
                                     "every turn needs non-blank text")


def cache_dir() -> Path:
    """Prompt cache folder: ``$FLASHSPEC_DATA`` or ``<repo>/.cache/data``."""
    env = os.environ.get("FLASHSPEC_DATA")
    return Path(env).expanduser() if env else repo_root() / ".cache" / "data"


def data_file(name: str) -> Path:
    """Cached JSONL file of one dataset; a clear error when it was never prepared."""
    _check_name(name, DATASETS)
    path = cache_dir() / FILES[name]
    if not path.is_file():
        raise FlashSpecError(f"{name} prompts not found at {path}; {PREPARE_HINT}")
    return path


def format_humaneval(code: str) -> str:
    """User turn for a HumanEval problem: instruction plus the function stub."""
    body = code.lstrip("\n").rstrip()
    return f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{body}\n```"


def format_gsm8k(question: str) -> str:
    """User turn for a GSM8K problem: the question plus a step-by-step instruction."""
    return f"{GSM8K_INSTRUCTION}\n\n{question.strip()}"


def load_prompts(name: str, n: int | None = None, seed: int = 0, split: str = "eval",
                 source: str = "local", block_size: int = 4,
                 domains: Sequence[str] | None = None) -> list[Prompt]:
    """Prompts of ``name`` (humaneval, gsm8k, mtbench, codeedit, mixed): the first ``n`` of the
    split; ``domains``: the prompt sets ``mixed`` interleaves (default :data:`MIXED_DOMAINS`)."""
    _check_name(name, STREAMS)
    _check_name(split, SPLITS, what="split")
    if n is not None and n <= 0:
        raise FlashSpecError(f"n={n} prompts requested; ask for at least 1 (or None for all)")
    if name == "mixed":
        prompts = _mixed(seed, split, source, block_size, n, _domains(domains))
    else:
        prompts = _ordered(_split(all_prompts(name, source))[split], name, seed)
    if n is not None and n > len(prompts):
        raise FlashSpecError(f"{name} {split} split has {len(prompts)} prompts, {n} requested; "
                             f"lower dataset.n_prompts to at most {len(prompts)}")
    return prompts[:n] if n is not None else prompts


@dataclass(frozen=True)
class PromptSet:
    """A prompt set of a run (``conf/dataset/*.yaml``): which prompts and how long the answers.

    ``n_prompts`` None is the whole split; ``seed`` picks the order (which n prompts), not the
    split; ``block_size`` and ``domains`` only shape ``mixed`` (prompts per domain block, the
    prompt sets it interleaves; None: :data:`MIXED_DOMAINS`).
    """

    name: str
    n_prompts: int | None = 8
    max_new_tokens: int = 128
    split: str = "eval"
    seed: int = 0
    source: str = "local"
    block_size: int = 4
    domains: Sequence[str] | None = None

    def __post_init__(self) -> None:
        _check_name(self.name, STREAMS)
        _check_name(self.split, SPLITS, what="split")
        _check_name(self.source, SOURCES, what="source")
        if self.domains is not None:
            object.__setattr__(self, "domains", _domains(self.domains))
        for key in ("n_prompts", "max_new_tokens", "block_size"):
            value = getattr(self, key)
            if value is None and key == "n_prompts":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise FlashSpecError(f"dataset.{key}={value!r}; it must be a positive int")

    def load(self, n: int | None = None) -> list[Prompt]:
        """The prompts (the first ``n`` of them when given: a smoke run)."""
        return load_prompts(self.name, n=n if n is not None else self.n_prompts, seed=self.seed,
                            split=self.split, source=self.source, block_size=self.block_size,
                            domains=self.domains)


def split_ids(name: str, split: str = "eval", source: str = "local") -> list[str]:
    """Ids of one split of a dataset, in the dataset's native order."""
    _check_name(name, DATASETS + tuple(DERIVED))
    _check_name(split, SPLITS, what="split")
    return [p.id for p in _split(all_prompts(name, source))[split]]


def all_prompts(name: str, source: str = "local") -> list[Prompt]:
    """Every prompt of a dataset in its native order (no split, no shuffle)."""
    _check_name(name, DATASETS + tuple(DERIVED))
    _check_name(source, SOURCES, what="source")
    if name == "codeedit":
        return [_codeedit(p) for p in all_prompts("humaneval", source)]
    return list(_all_prompts(name, source, str(cache_dir())))


def chat_ids(tokenizer: Any, turns_so_far: Sequence[str],
             answers_so_far: Sequence[str]) -> list[int]:
    """Token ids of the conversation so far, ending with the assistant's generation prompt.

    ``turns_so_far`` are the user turns up to the current one; ``answers_so_far`` are the
    model's own answers to all but the last (MT-Bench turn 2 follows the turn-1 answer).
    """
    if not turns_so_far:
        raise FlashSpecError("chat_ids needs at least one user turn")
    if len(answers_so_far) != len(turns_so_far) - 1:
        raise FlashSpecError(f"chat_ids got {len(turns_so_far)} user turns and "
                             f"{len(answers_so_far)} answers; pass one answer per earlier turn")
    if any(not isinstance(t, str) or not t.strip() for t in turns_so_far):
        raise FlashSpecError("chat_ids got an empty user turn; every turn needs non-blank text")
    if not getattr(tokenizer, "chat_template", None):
        raise FlashSpecError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat "
                             "template; use an instruct/chat model or set one on the tokenizer")
    messages: list[dict[str, str]] = []
    for i, turn in enumerate(turns_so_far):
        messages.append({"role": "user", "content": turn})
        if i < len(answers_so_far):
            messages.append({"role": "assistant", "content": answers_so_far[i]})
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)
    return [int(t) for t in enc["input_ids"]]


def data_hash(names: str | Sequence[str], source: str = "local") -> str:
    """sha256 (hex) naming the prompt data a run reads: over each dataset's name and file sha256
    (checked against ``manifest.json``), so any change to a prompt file changes it. ``mixed``
    stands for its datasets, a derived set for the file it is built from; ``source='hub'`` hashes
    the hub rows instead."""
    wanted = [names] if isinstance(names, str) else list(names)
    parts: list[str] = []
    for name in sorted({DERIVED.get(d, d) for n in wanted
                        for d in (DATASETS if n == "mixed" else (n,))}):
        _check_name(name, DATASETS)
        _check_name(source, SOURCES, what="source")
        if source == "local":
            digest = _verified_sha256(data_file(name))
        else:
            rows = json.dumps(_read_hub(name), sort_keys=True, default=str)
            digest = "hub:" + hashlib.sha256(rows.encode()).hexdigest()
        parts.append(f"{name}={digest}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _verified_sha256(path: Path) -> str:
    """The file's sha256, checked against the entry ``scripts/prepare_data.py`` wrote to
    ``manifest.json`` beside it (cached per path, size and mtime)."""
    stat = path.stat()
    return _verified_sha256_cached(str(path), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=64)
def _verified_sha256_cached(path_str: str, size: int, mtime_ns: int) -> str:
    path = Path(path_str)
    digest = file_sha256(path)
    manifest_path = path.parent / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    except (OSError, ValueError) as e:
        raise FlashSpecError(f"{manifest_path} is unreadable ({type(e).__name__}); delete it and "
                             f"{PREPARE_HINT} --force") from e
    entry = next((v for v in manifest.values()
                  if isinstance(v, dict) and v.get("file") == path.name), None)
    if entry is None or "sha256" not in entry:
        log.warning("%s has no sha256 in %s; its content cannot be checked (rerun "
                    "scripts/prepare_data.py --force to record it)", path, manifest_path)
    elif entry["sha256"] != digest:
        raise FlashSpecError(f"{path} differs from {manifest_path} (sha256 {digest[:12]}..., "
                             f"recorded {str(entry['sha256'])[:12]}...): the prompt file changed "
                             f"after it was prepared; delete it and {PREPARE_HINT}")
    return digest


def _check_name(value: str, allowed: Sequence[str], what: str = "dataset") -> None:
    if value not in allowed:
        raise FlashSpecError(f"unknown {what} {value!r}; choose one of {', '.join(allowed)}")


@lru_cache(maxsize=None)
def _all_prompts(name: str, source: str, folder: str) -> tuple[Prompt, ...]:
    """Parsed prompts, cached per (dataset, source, cache folder)."""
    rows = _read_rows(name, source)
    make = {"humaneval": _humaneval, "gsm8k": _gsm8k, "mtbench": _mtbench}[name]
    where = HUB.get(name, (name,))[0] if source == "hub" else data_file(name)
    prompts = []
    for i, row in enumerate(rows):
        try:
            prompts.append(make(i, row))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, FlashSpecError):
                raise FlashSpecError(f"{where} row {i + 1}: {e}") from e
            what = f"has no {e.args[0]!r} field" if isinstance(e, KeyError) else \
                f"is malformed ({type(e).__name__}: {e})"
            fix = f"delete it and {PREPARE_HINT}" if source == "local" else \
                f"set dataset.source=local and {PREPARE_HINT}"
            raise FlashSpecError(f"{where} row {i + 1} {what}; {fix}") from e
    return tuple(prompts)


def _read_rows(name: str, source: str) -> list[dict[str, Any]]:
    if source == "hub":
        return _read_hub(name)
    path = data_file(name)
    _verified_sha256(path)
    try:
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:  # any parse failure means a broken cache file
        raise FlashSpecError(f"cannot read {path} ({type(e).__name__}); delete it and "
                             f"{PREPARE_HINT}") from e
    if len(rows) != EXPECTED_ROWS[name]:
        raise FlashSpecError(f"{path} has {len(rows)} rows, expected {EXPECTED_ROWS[name]}; "
                             f"delete it and {PREPARE_HINT}")
    return rows


def _read_hub(name: str) -> list[dict[str, Any]]:
    import datasets

    if name not in HUB:
        raise FlashSpecError(f"{name} has no hub source; set dataset.source=local and "
                             f"{PREPARE_HINT}")
    repo, config = HUB[name]
    try:
        return list(datasets.load_dataset(repo, config, split="test"))
    except Exception as e:  # noqa: BLE001 - offline, missing or renamed hub dataset
        raise FlashSpecError(f"cannot load {repo} from the hub ({type(e).__name__}); set "
                             f"dataset.source=local and {PREPARE_HINT}") from e


def _humaneval(i: int, row: Mapping[str, Any]) -> Prompt:
    task = str(row["task_id"])
    return Prompt(id=f"humaneval/{task.split('/')[-1]}", dataset="humaneval", domain="code",
                  category="code", turns=[format_humaneval(row["prompt"])],
                  reference=row.get("canonical_solution"),
                  meta={"task_id": task, "entry_point": row.get("entry_point"),
                        "code": row["prompt"], "test": row.get("test")})


def _gsm8k(i: int, row: Mapping[str, Any]) -> Prompt:
    answer = row.get("answer") or ""
    final = answer.rsplit("####", 1)[-1].strip() if "####" in answer else None
    return Prompt(id=f"gsm8k/{i}", dataset="gsm8k", domain="math", category="math",
                  turns=[format_gsm8k(row["question"])], reference=answer or None,
                  meta={"question": row["question"], "final_answer": final})


def _mtbench(i: int, row: Mapping[str, Any]) -> Prompt:
    refs = [r for r in (row.get("reference") or []) if r]
    return Prompt(id=f"mtbench/{row['question_id']}", dataset="mtbench", domain="chat",
                  category=str(row["category"]), turns=[str(t) for t in row["turns"]],
                  reference=refs[0] if refs else None,
                  meta={"question_id": int(row["question_id"]), "references": refs})


def _codeedit(task: Prompt) -> Prompt:
    """The code-editing prompt of a HumanEval task: its whole reference function and an edit
    picked by the task id's hash."""
    number = task.id.split("/")[-1]
    code = (str(task.meta["code"]) + (task.reference or "")).strip("\n")
    pick = int(hashlib.sha256(f"flashspec-codeedit:{task.id}".encode()).hexdigest(), 16)
    edit = CODE_EDITS[pick % len(CODE_EDITS)].format(name=task.meta.get("entry_point") or "f")
    turn = (f"Here is a Python function:\n\n```python\n{code}\n```\n\n{edit} Reply with the "
            "full function in a Python code block.")
    return Prompt(id=f"codeedit/{number}", dataset="codeedit", domain="edit", category="edit",
                  turns=[turn], meta={"source_id": task.id, "edit": edit,
                                      "entry_point": task.meta.get("entry_point")})


def _split_key(prompt_id: str) -> str:
    return hashlib.sha256(f"flashspec-split-v1:{prompt_id}".encode()).hexdigest()


def _split(prompts: Sequence[Prompt]) -> dict[str, list[Prompt]]:
    """Stratified, seed-independent eval/train split (see the module docstring); a derived
    prompt is ranked by the id of the prompt it was built from (``meta['source_id']``)."""
    train: set[str] = set()
    for cat in dict.fromkeys(p.category for p in prompts):
        ranked = sorted((p for p in prompts if p.category == cat),
                        key=lambda p: _split_key(p.meta.get("source_id", p.id)))
        train.update(p.id for p in ranked[:math.floor(TRAIN_FRACTION * len(ranked))])
    return {"eval": [p for p in prompts if p.id not in train],
            "train": [p for p in prompts if p.id in train]}


def _ordered(prompts: Sequence[Prompt], name: str, seed: int) -> list[Prompt]:
    """Seeded shuffle inside each category, then round-robin over categories."""
    rng = random.Random(f"flashspec-order:{name}:{seed}")
    groups = []
    for cat in dict.fromkeys(p.category for p in prompts):
        group = [p for p in prompts if p.category == cat]
        rng.shuffle(group)
        groups.append(group)
    longest = max((len(g) for g in groups), default=0)
    return [g[i] for i in range(longest) for g in groups if i < len(g)]


def _domains(domains: Sequence[str] | None) -> tuple[str, ...]:
    """The prompt sets of a mixed stream, checked: known, distinct, at least two."""
    if domains is None:
        return MIXED_DOMAINS
    if isinstance(domains, str):
        domains = [domains]
    out = tuple(str(d) for d in domains)
    for d in out:
        _check_name(d, DATASETS + tuple(DERIVED), what="dataset.domains entry")
    if len(set(out)) != len(out) or len(out) < 2:
        raise FlashSpecError(f"dataset.domains={list(out)}; a mixed stream needs at least two "
                             "different prompt sets")
    return out


def _mixed(seed: int, split: str, source: str, block_size: int, n: int | None,
           domains: tuple[str, ...] = MIXED_DOMAINS) -> list[Prompt]:
    """Blocks of the domains in a seeded order, no domain twice in a row."""
    if block_size <= 0:
        raise FlashSpecError(f"block_size={block_size}; use a positive block size")
    pools = {d: _ordered(_split(all_prompts(d, source))[split], d, seed) for d in domains}
    per_domain = min(len(p) for p in pools.values())
    if n is not None:
        per_domain = min(per_domain, math.ceil(n / len(domains)))
    blocks = {d: [pool[i:i + block_size] for i in range(0, per_domain, block_size)]
              for d, pool in pools.items()}
    rng = random.Random(f"flashspec-mixed:{seed}")
    stream: list[Prompt] = []
    last = None
    for r in range(max(len(b) for b in blocks.values())):
        order = list(domains)
        rng.shuffle(order)
        if order[0] == last:
            order.append(order.pop(0))
        for d in order:
            stream.extend(blocks[d][r])
        last = order[-1]
    return stream
