"""experiment=decode: target-only AR, speculative decoding and HF baselines on the same prompts;
experiment=bench (experiments/bench.py) runs here too, with named methods (:func:`bench_methods`).

Writes one JSONL record per (prompt, turn, method) into ``records.jsonl`` of the run
directory, flushed as it goes; rerunning into the same directory resumes where it stopped.
Prints and logs a summary table (α, τ, TPS, speedup per dataset and method).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from experiments.harness import (TWIN, RunDir, bench_method, bench_specs, build, build_arms,
                                 build_drafters, draft_context, drafter_builder, engine_options,
                                 load_target, make_planner, make_policy, prompt_set, run_dir,
                                 takes_head)
from flashspec.bandits import Policy
from flashspec.core import Arm, SamplingParams
from flashspec.data import Prompt, chat_ids
from flashspec.engine import SpecEngine
from flashspec.errors import FlashSpecError
from flashspec.analysis.head_timing import head_latency
from flashspec.bandits import FixedArm
from flashspec.heads import FullHeadChoice, LowRankChoice, resolve_rank
from flashspec.paths import file_sha256, repo_path
from flashspec.records import DecodeRecord, config_hash
from flashspec.metrics import (arm_mean_rewards, arm_method, bandit_vs_fixed, decode_stats,
                               format_bandit_vs_fixed, format_table, method_records, percentile,
                               pick_counts, policy_regret, pooled_tps, priced_rate, rates,
                               step_overhead, summarize, vs_best_interval)
from flashspec.theory import kappa, rho_tps
from flashspec.seeds import derive_seed

log = logging.getLogger(__name__)
METHODS = ("ar", "spec", "each_arm", "hf_generate", "hf_compiled", "hf_prompt_lookup")
REFERENCES = ("each_arm", "full_head")   # what the job's metrics compare against (regret, ρ_τ)
HF_METHODS = {"hf_generate": {}, "hf_compiled": {"cache_implementation": "static"},
              "hf_prompt_lookup": {}}


@dataclass
class Method:
    """A named way to decode a batch: ``run(prompt_ids, max_new, domain, seed, learn=True) ->
    list[dict]`` of row stats (``learn=False``: an untimed call that teaches its policy nothing)."""

    name: str
    run: Callable[..., list[dict[str, Any]]]
    key: dict[str, Any] | None = None   # what decides its records besides the run-wide part
                                        # (run_key); None: a policy's method, never reused


def engine_method(name: str, engine: SpecEngine, key: dict[str, Any] | None = None) -> Method:
    trees = {i: a.tree.label for i, a in enumerate(engine.arms) if a.tree is not None}

    def run(prompts: list[list[int]], max_new: int, domain: str | None,
            seed: int | None = None, learn: bool = True) -> list[dict[str, Any]]:
        res = engine.generate(prompts, max_new, domain=domain, seed=seed, learn=learn)
        return [{"tokens": r.tokens, "wall_s": res.wall_s, "decode_s": res.decode_s,
                 "steps": r.steps, "n_proposed": r.n_proposed, "n_accepted": r.n_accepted,
                 "accept_hist": r.accept_hist, "arms": r.arms, "rewards": r.rewards,
                 "step_p50_s": percentile(res.step_s, 50), "step_p99_s": percentile(res.step_s, 99),
                 "capture_s": res.capture_s,
                 **({"trees": {str(i): t for i, t in trees.items()}} if trees else {})}
                for r in res.rows]
    return Method(name, run, key)


def hf_method(name: str, hf_model, params: SamplingParams, eos: list[int], lookup: int | None,
              extra: dict[str, Any] | None = None) -> Method:
    """HF transformers' own generate (greedy or sampled), optionally with prompt lookup.

    ``extra`` goes to ``generate``: ``cache_implementation="static"`` makes transformers compile
    the decoding step (torch.compile, CUDA graphs) on a GPU: the ``hf_compiled`` baseline.
    """
    def run(prompts: list[list[int]], max_new: int, domain: str | None,
            seed: int | None = None, learn: bool = True) -> list[dict[str, Any]]:
        if seed is not None:
            torch.manual_seed(seed)
        out = []
        for p in prompts:
            ids = torch.tensor([p], device=hf_model.device)
            kwargs = dict(max_new_tokens=max_new, do_sample=not params.greedy, eos_token_id=eos,
                          pad_token_id=eos[0] if eos else None, **(extra or {}))
            if not params.greedy:
                kwargs.update(temperature=params.temperature, top_k=params.top_k or None,
                              top_p=params.top_p)
            if lookup:
                kwargs["prompt_lookup_num_tokens"] = lookup
            t0 = time.perf_counter()
            with torch.inference_mode():
                gen = hf_model.generate(ids, **kwargs)
            wall = time.perf_counter() - t0
            toks = gen[0, len(p):].tolist()
            out.append({"tokens": toks, "wall_s": wall, "decode_s": wall, "steps": 0,
                        "n_proposed": 0, "n_accepted": 0, "accept_hist": [], "arms": [],
                        "rewards": []})
        return out
    return Method(name, run, {"kind": name, "lookup": lookup, "generate": extra or {}})


def spec_name(arms: list[Arm], policy: Policy) -> str:
    """``spec:<arm>`` for a fixed arm, ``spec:bandit:<policy label>`` for a learning policy."""
    if not policy.learns:
        return arm_method(arms[int(policy.select())].label)
    return f"spec:bandit:{policy.label}"


@dataclass
class Learner:
    """Policies over one arm list whose priors a job reads before its first step and writes at
    its end (experiments/priors.py): ``alone`` maps an arm index to the method that plays that
    arm alone in this job (the unbiased measure of it), ``spec`` the method the first policy
    plays (its steps measure the arms no method plays alone)."""

    policies: list[Policy]
    arm_labels: list[str]
    alone: dict[int, str]
    spec: str | None


@dataclass
class Plan:
    """The methods of one decode job and what each one is for.

    ``spec``: the configured method (policy over the arms) and ``extra``: more policies over the
    same arms; ``arms``: each arm alone (the reference for regret), by arm index;
    ``full_head``: the head-axis drafter's first arm with its full head (the ρ_τ reference) and
    ``variant``: the same arm with the configured head; ``heads``: (variant, full) head modules
    of that drafter (for ν and κ); ``policy_arms``: the arms the policy chooses from, in its
    index order.
    """

    methods: list[Method]
    policy_arms: list[Arm]
    spec: str | None = None
    extra: list[str] = field(default_factory=list)
    arms: dict[int, str] = field(default_factory=dict)
    full_head: str | None = None
    variant: str | None = None
    heads: tuple | None = None
    gamma: int = 0
    head: dict[str, Any] = field(default_factory=dict)
    policies: list[Policy] = field(default_factory=list)   # spec's, then the extra ones
    reference: str = "backbone"   # ρ_τ's full-head drafter: twin | backbone (_full_head_reference)
    named: list[str] = field(default_factory=list)   # experiment=bench: role = method name
    named_arms: dict[str, list[str]] = field(default_factory=dict)   # bench method -> arm labels
    named_alone: dict[str, dict[int, str]] = field(default_factory=dict)   # bench: arms played alone
    bench_learners: list[Learner] = field(default_factory=list)   # bench methods that learn

    def learners(self) -> list[Learner]:
        """Every learning policy group of the job, for the priors store: the configured
        policies over the drafter set's arms, then each learning bench method."""
        own = [Learner(self.policies, self.arm_names, self.arms, self.spec)] if self.policies else []
        return own + self.bench_learners

    @property
    def arm_names(self) -> list[str]:
        """The policy's arms as records and metrics name them (:attr:`Arm.label`)."""
        return [a.label for a in self.policy_arms]

    def roles(self) -> dict[str, str]:
        """Method name -> its role, the prefix of its metrics (identical across a sweep's jobs:
        ``spec`` is the configured method whatever the policy is called)."""
        out = {"ar": "ar", **{m.name: m.name for m in self.methods if m.name.startswith("hf_")},
               **{m: m for m in self.named},
               **{m: f"arm/{self.arm_names[i]}" for i, m in self.arms.items()},
               **{m: f"extra/{m.removeprefix('spec:bandit:')}" for m in self.extra}}
        if self.full_head:
            out[self.full_head] = "ref_full_head"
        if self.spec:
            out[self.spec] = "spec"
        return out


def build_methods(cfg: DictConfig, target, tokenizer, params: SamplingParams, eos: list[int]) -> Plan:
    """The methods named in ``experiment.methods`` plus the ``experiment.references`` the job's
    metrics need (``each_arm``: every arm alone; ``full_head``: the head-axis drafter with its
    full head), sharing one target model."""
    exp = cfg.experiment
    if isinstance(exp.methods, DictConfig):
        return bench_methods(cfg, target, tokenizer, params, eos)
    wanted = list(exp.methods) + [r for r in exp.get("references") or [] if r not in exp.methods]
    unknown = [m for m in wanted if m not in METHODS + REFERENCES]
    if unknown:
        raise FlashSpecError(f"unknown decode method(s) or reference(s) {unknown}; methods: "
                             f"{list(METHODS)}, references: {list(REFERENCES)}")
    kw = engine_options(cfg, params, eos)
    plan = Plan(methods=[], policy_arms=[])
    arms: list[Arm] = []
    policies: list = []
    if {"spec", "each_arm", "full_head"} & set(wanted):
        ctx = draft_context(cfg, target, tokenizer)
        drafters = build_drafters(cfg.drafters, ctx)
        arms = build_arms(cfg.drafters, drafters)
        kw["drafters"] = list(drafters.values())
        plan.policy_arms = arms
        policies = [make_policy(b, len(arms), int(cfg.seed))
                    for b in [cfg.bandit, *(exp.get("extra_bandits") or {}).values()]]
        plan.policies = policies
    for m in wanted:
        if m == "ar":
            plan.methods.append(engine_method("ar", SpecEngine(target, [Arm()], **kw),
                                              {"kind": "ar"}))
        elif m == "spec":
            for k, policy in enumerate(policies):
                planner = make_planner(cfg)
                name = spec_name(arms, policy) + ("" if planner is None else "+goodput")
                if k == 0:
                    plan.spec = name
                else:
                    plan.extra.append(name)
                plan.methods.append(engine_method(name, SpecEngine(target, arms, policy, planner=planner, **kw)))
        elif m == "each_arm":
            # beside a learning policy the arms are timed in this job, rotated with it batch by
            # batch: a copy from an earlier job of the sweep was timed minutes before, and on a
            # CPU that drift is larger than the policy-vs-best-arm gap the comparison measures
            timed_here = "spec" in wanted and any(p.learns for p in policies)
            for i, a in enumerate(arms):
                plan.arms[i] = arm_method(a.label)
                if plan.arms[i] in (m.name for m in plan.methods):   # bandit=fixed already runs it
                    continue
                fixed = FixedArm(1, reward=policies[0].reward_kind)   # the policy's own reward kind
                plan.methods.append(engine_method(plan.arms[i], SpecEngine(target, [a], fixed, **kw),
                                                  None if timed_here else
                                                  arm_key_of(cfg, a, fixed.reward_kind)))
        elif m == "full_head":
            _full_head_reference(cfg, plan, ctx, drafters, arms, kw)
        else:
            lookup = int(exp.hf_prompt_lookup_tokens) if m == "hf_prompt_lookup" else None
            plan.methods.append(hf_method(m, _hf_model(cfg, target), params, eos, lookup, HF_METHODS[m]))
    names = [m.name for m in plan.methods]
    if len(set(names)) != len(names):
        raise FlashSpecError(f"two methods share a name: {names}")
    return plan


def bench_methods(cfg: DictConfig, target, tokenizer, params: SamplingParams,
                  eos: list[int]) -> Plan:
    """experiment=bench: ``experiment.methods`` maps a method name to its arms and optionally
    its own runtime, bandit and planner (:func:`experiments.harness.bench_method`).
    Every method is a SpecEngine over the run's target and drafters (built once: the target's
    fused layers and the drafters' kernel switches are the run runtime's), named by its key;
    ``ar`` (required) is the reference of every speedup and greedy_equal. A method set to null
    (``experiment.methods.tree_planner=null``) is left out."""
    specs = bench_specs(cfg)
    ctx = draft_context(cfg, target, tokenizer)
    drafters = build_drafters(cfg.drafters, ctx)
    plan = Plan(methods=[], policy_arms=[])
    plays = {}   # method -> what makes two methods play an arm the same way
    for name, spec in specs.items():
        m = bench_method(cfg, name, spec)
        plays[name] = (m.runtime, m.planner is not None)
        try:
            arms = build_arms({"arms": spec.arms}, drafters)
        except FlashSpecError as e:
            raise FlashSpecError(f"experiment.methods.{name}: {e}") from None
        kw = {**engine_options(cfg, params, eos, m.runtime), "drafters": list(drafters.values())}
        engine = SpecEngine(target, arms, m.policy, planner=m.planner, **kw)
        plan.methods.append(engine_method(name, engine))
        if name != "ar":
            plan.named.append(name)
            plan.named_arms[name] = [a.label for a in arms]
        if m.policy is not None and m.policy.learns:
            plan.bench_learners.append(Learner([m.policy], [a.label for a in arms], {}, name))
    plan.named_alone = arms_played_alone(plan.named_arms, plays)
    for ln in plan.bench_learners:
        ln.alone.update(plan.named_alone.get(ln.spec, {}))
    return plan


def arms_played_alone(named_arms: dict[str, list[str]],
                      plays: dict[str, tuple]) -> dict[str, dict[int, str]]:
    """For each bench method over several arms, arm index -> the first one-arm method that plays
    that arm as the method does (``plays``: method -> (runtime, has a planner); a planner
    changes what an arm does). Both the priors store and ``vs_best_fixed`` measure arms by it."""
    out: dict[str, dict[int, str]] = {}
    for name, labels in named_arms.items():
        if len(labels) < 2:
            continue
        out[name] = {}
        for i, label in enumerate(labels):
            alone = [o for o, arms in named_arms.items() if arms == [label]
                     and plays[o] == plays[name]]
            if alone:
                out[name][i] = alone[0]
    return out


def _full_head_reference(cfg: DictConfig, plan: Plan, ctx, drafters: dict, arms: list[Arm],
                         kw: dict) -> None:
    """The ρ_τ reference: the first arm whose drafter takes the run's head choice, run with a
    full head, same γ, same prompts. With a ``twin`` in the drafter's entry (its full-head twin,
    trained the same way: SlimSpec's ρ_τ) that drafter decodes (``ref_twin:<arm>``), after
    checking the twin keys match; else the same backbone with the full head
    (``ref_full_head:<arm>``). ``rho_tau_reference`` in the job metrics says which."""
    entries = cfg.drafters.drafters
    for i, arm in enumerate(arms):
        if arm.drafter is None or not takes_head(entries[arm.drafter]):
            continue
        entry = entries[arm.drafter]
        twin = entry.get(TWIN)
        choice = build(cfg.head)
        rank = resolve_rank(choice.rank, ctx.target.shape.hidden_size) \
            if isinstance(choice, LowRankChoice) else None
        override = {}
        if twin:
            _check_twin_arm(entry, str(twin), arm.drafter, choice, rank)
            override = {"checkpoint": str(twin)}
        full = drafter_builder(entry)(ctx=ctx, name=arm.drafter, head=FullHeadChoice(), **override)
        name = f"ref_{'twin' if twin else 'full_head'}:{arm.label}"
        engine = SpecEngine(ctx.target, [arm], **{**kw, "drafters": [full]})
        plan.methods.append(engine_method(name, engine, arm_key_of(
            cfg, arm, engine.policy.reward_kind, full_head=True)))
        plan.full_head, plan.variant, plan.gamma = name, f"spec:{arm.label}", arm.gamma
        plan.reference = "twin" if twin else "backbone"
        variant = drafters[arm.drafter]
        plan.heads = (variant.head, full.head)
        plan.head = {"drafter": arm.drafter, "kind": choice.kind, "rank": rank,
                     "params": module_size(variant.head), "full_params": module_size(full.head),
                     "rho_tau_reference": plan.reference}
        plan.arms.setdefault(i, plan.variant)
        if plan.variant not in (m.name for m in plan.methods):   # the variant arm alone, too
            engine = SpecEngine(ctx.target, [arm], **kw)
            plan.methods.append(engine_method(plan.variant, engine, arm_key_of(
                cfg, arm, engine.policy.reward_kind)))
        return


def _check_twin_arm(entry: DictConfig, twin: str, drafter: str, choice, rank: int | None) -> None:
    """A twin reference is refused unless the drafter is the low-rank drafter of the twin's
    group: same twin key, and the run's head is the one trained into its checkpoint (the
    trained head of its rank, not an SVD or another file)."""
    from flashspec.training.twins import check_twins, read_twin
    if "checkpoint" not in entry:
        raise FlashSpecError(f"drafters.{drafter}.twin needs a drafter trained from a checkpoint "
                             "(drafters.<name>.checkpoint), the low-rank drafter of a twin group")
    check_twins(str(entry.checkpoint), twin)
    baked = read_twin(str(entry.checkpoint)).get("checkpoint_head") or {}
    trained = isinstance(choice, LowRankChoice) and choice.init == "trained" and not choice.checkpoint
    if not trained or baked.get("rank") != rank:
        raise FlashSpecError(f"drafters.{drafter}.twin: {entry.checkpoint} is the twin group's "
                             f"rank-{baked.get('rank')} drafter, the run's head is "
                             f"{choice.kind} {getattr(choice, 'init', '')} rank {rank}; use its "
                             "trained head (head=lowrank head.init=trained, head.rank its rank) "
                             "or pick the checkpoint of the run's rank")


def module_size(module: torch.nn.Module) -> int:
    """Parameters and buffers of a head (a cast copy of the full head keeps its weight as a buffer)."""
    return sum(t.numel() for t in [*module.parameters(), *module.buffers()])


_HF_CACHE: dict = {}


def _hf_model(cfg: DictConfig, target):
    """The same target weights as an HF transformers model (for HF's own generate).

    A model directory (or a GGUF, through its converted directory) loads as usual; a dummy
    target gets an HF model of its config holding the native model's (random) weights.
    """
    from transformers import AutoModelForCausalLM
    from flashspec.models.loading import gguf_dir, model_dir, resolve_dtype, source_config
    src, dtype = cfg.target.source, resolve_dtype(cfg.target.dtype)
    key = (src, cfg.hardware.device)
    if key not in _HF_CACHE:
        if src.startswith("dummy:"):
            model = AutoModelForCausalLM.from_config(source_config(src), dtype=dtype)
            state = {k if k.startswith("lm_head.") else "model." + k: v
                     for k, v in target.state_dict().items() if "inv_freq" not in k}
            model.load_state_dict(state, strict=False)
        else:
            directory = gguf_dir(Path(src)) if src.endswith(".gguf") else model_dir(src)
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
        model.generation_config.max_cache_len = 4096  # one static cache size: no recompiles
        _HF_CACHE[key] = model.to(cfg.hardware.device).eval()
    return _HF_CACHE[key]


# ----------------------------------------------------------------------------- reuse in a sweep
# The records of a method that no swept setting touches (target-only AR, HF baselines, each arm
# alone, the full-head reference: none of them depends on the bandit, and AR, HF and the full
# head not on the head choice either) are the same in every job of a sweep; a later job of the
# same multirun, run by the same process (Hydra's basic launcher), copies them from the job that
# decoded them instead of decoding them again. Keyed by content: the sweep folder, the run-wide
# settings (target, hardware, runtime, dataset and the prompts' text, max new tokens, seed,
# sampling, batching, warm-up), the method's own (arm: its drafter entry resolved, checkpoint
# files by content, γ, reward kind) and the code (every flashspec/ and experiments/ source file,
# torch and transformers versions). Copied records keep their timings and say where they come
# from (``reused_from``); ``experiment.reuse=false`` decodes everything in every job. Each arm
# alone is not copied into a job that runs a learning policy: the policy is compared with the
# arms timed beside it.
_REUSE: dict[str, dict[str, Any]] = {}
RUN_KEY_SKIP = {"drafters", "head", "bandit", "priors", "planner", "logger", "resume", "output_dir",
                "hydra"}
EXPERIMENT_KEY_SKIP = {"methods", "references", "extra_bandits", "timing_iters", "records", "reuse"}


def reuse_scope(cfg: DictConfig) -> str | None:
    """The multirun this job belongs to (its sweep folder), or None (a single run, or
    ``experiment.reuse=false``): records are reused only among jobs of one multirun."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    if not cfg.experiment.get("reuse", True) or not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    return str(Path(hc.sweep.dir).resolve()) if hc.mode == RunMode.MULTIRUN else None


@lru_cache(maxsize=1)
def code_version() -> str:
    """sha256 of every flashspec/ and experiments/ source file and the torch and transformers
    versions (taken once per process: the code a process runs does not change under it)."""
    import transformers
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(f"torch {torch.__version__} transformers {transformers.__version__}".encode())
    for path in sorted([*(root / "flashspec").rglob("*.py"), *(root / "experiments").glob("*.py")]):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _with_file_hashes(value: Any) -> Any:
    """A resolved config value with every string that names a file replaced by that file's
    path and content hash (a retrained checkpoint at the same path is another drafter)."""
    if isinstance(value, dict):
        return {k: _with_file_hashes(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_file_hashes(v) for v in value]
    if isinstance(value, str) and value and repo_path(value).is_file():   # as drafters resolve it
        return {"file": value, "sha256": file_sha256(repo_path(value))}
    return value


def arm_key(cfg: DictConfig, drafter: str, gamma: int, reward: str, full_head: bool = False,
            tree: str | None = None) -> dict:
    """What decides the records of one arm played alone: its drafter entry (resolved: the
    run's head choice when it takes it; with ``full_head`` the entry without it, since the full
    head replaces it), γ (and the tree shape of a tree arm) and the reward kind the records
    carry."""
    entry = OmegaConf.to_container(cfg.drafters.drafters[drafter], resolve=True)
    if full_head:   # the full head replaces the run's; a twin checkpoint the drafter's own
        twin = {"checkpoint": entry[TWIN]} if entry.get(TWIN) else {}
        entry = {**{k: v for k, v in entry.items() if k not in ("head", TWIN)}, **twin,
                 "head": "full"}
    key = {"kind": "arm", "drafter": drafter, "entry": _with_file_hashes(entry),
           "gamma": int(gamma), "reward": reward}
    return key if tree is None else {**key, "tree": tree}


def arm_key_of(cfg: DictConfig, arm: Arm, reward: str, full_head: bool = False) -> dict:
    return arm_key(cfg, arm.drafter, arm.gamma, reward, full_head,
                   arm.tree.label if arm.tree is not None else None)


def run_key(cfg: DictConfig, prompts: list[Prompt], max_new: int) -> dict[str, Any]:
    """What decides every method's records: the whole resolved config except what only the
    policy's methods read or what does not touch records (``RUN_KEY_SKIP``,
    ``EXPERIMENT_KEY_SKIP``; a method's drafter entry goes into its own key), the prompts' text
    and the number of new tokens."""
    c = OmegaConf.to_container(cfg, resolve=True)
    out = {k: v for k, v in c.items() if k not in RUN_KEY_SKIP and k != "experiment"}
    out["experiment"] = {k: v for k, v in c["experiment"].items() if k not in EXPERIMENT_KEY_SKIP}
    out["prompts"] = [dataclasses.asdict(p) for p in prompts]
    out["max_new_tokens"] = int(max_new)
    return out


def reuse_key(scope: str, run: dict[str, Any], method: Method) -> str | None:
    if method.key is None:
        return None
    return config_hash({"scope": scope, "run": run, "method": method.name, "key": method.key,
                        "code": code_version()}, ignore=())


def _reuse_records(run: RunDir, keys: dict[str, str], done: set, roles: dict[str, str]) -> dict[str, str]:
    """Writes the stored records of every method of this job that an earlier job of the sweep
    decoded (a method this directory already holds records of is left to resume); returns
    method -> the run directory its records come from."""
    reused: dict[str, str] = {}
    for name, key in keys.items():
        stored = _REUSE.get(key)
        if stored is None or any(k[0] == name for k in done):
            continue
        reused[name] = stored["origin"]
    if not reused:
        return reused
    run.provenance["reused_from"] = reused
    for name, origin in reused.items():
        for rec in _REUSE[keys[name]]["records"]:
            rec = {**{k: v for k, v in rec.items() if k != "provenance"}, "reused_from": origin}
            run.write(rec)
            run.logger.log({f"prompt/{roles.get(name, name)}/{k}": rec[k]
                            for k in ("tps", "alpha", "tau") if rec[k] is not None})
    log.info("reused the records of %d method(s) from earlier jobs of this sweep (same target, "
             "prompts, seed, sampling, drafter and code; experiment.reuse=false decodes them "
             "again): %s", len(reused), ", ".join(f"{n} <- {Path(o).name}" for n, o in reused.items()))
    return reused


def _remember(records: list[dict], keys: dict[str, str], prompts: list[Prompt], origin: str) -> None:
    """Stores the records of every reusable method that has one per (prompt, turn)."""
    want = {(p.id, t) for p in prompts for t in range(len(p.turns))}
    for name, key in keys.items():
        recs = [r for r in records if r["method"] == name]
        if key not in _REUSE and {(r["prompt_id"], r["turn"]) for r in recs} == want \
                and len(recs) == len(want):
            _REUSE[key] = {"origin": recs[0].get("reused_from", origin),
                           "records": json.loads(json.dumps(recs))}


def prompt_turn_ids(tokenizer, prompt: Prompt, answers: list[str]) -> list[int]:
    return chat_ids(tokenizer, prompt.turns[:len(answers) + 1], answers)


def run(cfg: DictConfig) -> dict[str, Any]:
    """Decode every prompt with every method; returns the summary rows and the job metrics."""
    torch.manual_seed(int(cfg.seed))
    exp = cfg.experiment   # values typed and in range: experiments.schema, checked at composition
    params = SamplingParams(float(exp.temperature), int(exp.top_k), float(exp.top_p))
    dataset = prompt_set(cfg)
    max_new = 8 if cfg.smoke else dataset.max_new_tokens
    prompts = dataset.load(1 if cfg.smoke else None)
    if exp.get("max_turns") is not None:   # MT-Bench first turns only (experiment=bench)
        prompts = [dataclasses.replace(p, turns=p.turns[:int(exp.max_turns)]) for p in prompts]
    target, tokenizer = load_target(cfg)
    eos = [int(tokenizer.eos_token_id)] if tokenizer.eos_token_id is not None else []
    plan = build_methods(cfg, target, tokenizer, params, eos)
    methods, roles = plan.methods, plan.roles()
    arms = plan.policy_arms
    resolved = {"arms": plan.arm_names,
                "gammas": sorted({a.gamma for a in arms if a.drafts and a.tree is None}),
                "trees": sorted({a.tree.label for a in arms if a.tree is not None}),
                "head": plan.head, "methods": [m.name for m in methods]}
    scope = reuse_scope(cfg)
    keys: dict[str, str] = {}
    if scope is not None:
        common = run_key(cfg, prompts, max_new)
        keys = {m.name: k for m in methods if (k := reuse_key(scope, common, m)) is not None}
    with run_dir(cfg, exp.records, {"resolved": resolved}, data=dataset.name) as run:
        # priors (experiments/priors.py): policies start from the store before any step,
        # warm-up included; what this job measured is written at the end
        from experiments import priors as carried
        started = {k: v for ln in plan.learners()
                   for k, v in carried.warm_start(cfg, ln.policies, ln.arm_labels, prompts).items()}
        if started:
            run.provenance["priors"] = started
        done = run.done_keys("method", "prompt_id", "turn")
        reused = _reuse_records(run, keys, done, roles)
        units = [(p.id, t) for p in prompts for t in range(len(p.turns))]
        pending = {m.name: sum((m.name, *u) not in done for u in units)
                   for m in methods if m.name not in reused}
        todo = [m for m in methods if pending.get(m.name)]
        batches = [prompts[i:i + int(exp.batch_size)] for i in range(0, len(prompts), int(exp.batch_size))]
        # untimed, on the first batch's prompts; its wall time is the cold start. It teaches no
        # policy: its steps' seconds are a cold start's, and an arm timed there would be priced
        # slow for the whole run
        if exp.warmup and todo:
            warm = [prompt_turn_ids(tokenizer, p, []) for p in batches[0]]
            cold: dict[str, float] = {}
            for m in todo:
                t0 = time.perf_counter()
                m.run(warm, 4, None, learn=False)
                cold[m.name] = time.perf_counter() - t0
            run.provenance["cold_start_s"] = cold
        if exp.get("prefill_all") and todo:
            # Kernels specialise on prompt-length buckets: the first method to meet a new bucket
            # would pay its compilation inside its timed call (with rotation, a different
            # method each batch). Every method prefills every batch's first turn once, untimed.
            t0 = time.perf_counter()
            for m in todo:
                for batch in batches:
                    m.run([prompt_turn_ids(tokenizer, p, []) for p in batch], 2, None,
                          learn=False)
            run.provenance["prefill_all_s"] = time.perf_counter() - t0
        if todo:
            log.info("decoding %d (prompt, turn) record(s) of %s: %s", sum(pending.values()),
                     dataset.name, ", ".join(f"{m.name} x{pending[m.name]}" for m in todo))
        else:
            log.info("nothing to decode: every method has its %d record(s) of %s here already",
                     len(units), dataset.name)
        with tqdm(total=len(batches) * len(todo), desc="decode", unit="batch", disable=not todo) as bar:
            for bi, batch in enumerate(batches):
                for m in (_order(todo, bi, bool(exp.get("rotate_methods", True))) if todo else []):
                    _decode_batch(m, batch, bi, tokenizer, max_new, params, run, done,
                                  roles.get(m.name, m.name))
                    bar.update()
        from flashspec.records import read_records
        records = list(read_records(run.writer.path, experiment="decode"))
        _remember(records, keys, prompts, str(run.path))
        for ln in plan.learners():
            carried.save(cfg, records, ln.arm_labels, ln.alone, ln.spec,
                         ln.policies[0].reward_kind, run.path)
        rows = summarize(records)
        log.info("records: %s\n%s", run.writer.path, format_table(rows))
        cmp = bandit_vs_fixed(records)
        if cmp is not None:
            log.info("%s", format_bandit_vs_fixed(cmp))
            run.logger.summary({f"pooled/{k}": cmp[k] for k in
                                ("vs_best_fixed", "vs_mean_fixed", "oracle_vs_best_fixed")})
            if cmp["vs_best_fixed_interval"]:
                keys = ("pooled/vs_best_fixed_p05", "pooled/vs_best_fixed_p95")
                run.logger.summary(dict(zip(keys, cmp["vs_best_fixed_interval"])))
        _stream_figure(records, cfg, run.path)
        job, regret = job_metrics(records, plan, target, 5 if cfg.smoke else int(exp.timing_iters))
        costs = [f"  {k.removesuffix('/step_overhead')}: {v:.3f} ({job[k + '_prompts']} prompts)"
                 for k, v in job.items() if k.endswith("/step_overhead")]
        if costs:
            log.info("seconds per step of a policy over its arm's alone, on the prompts it "
                     "played on one arm (median):\n%s", "\n".join(costs))
        priced = [f"  {k.removesuffix('/priced_vs_best_fixed')}: {v:.3f}"
                  for k, v in job.items() if k.endswith("/priced_vs_best_fixed")]
        if priced:
            log.info("a policy's choices priced at each arm's seconds per step alone on the same "
                     "prompt, over the best arm alone (its own cost left out):\n%s",
                     "\n".join(priced))
        log.info("job metrics:\n%s", "\n".join(f"  {k} = {_fmt(v)}" for k, v in job.items()))
        for step, value in enumerate(regret):   # x axis: regret/t
            run.logger.log({"regret/t": step + 1, "regret/cumulative": value})
        run.logger.table("summary", rows)
        run.logger.summary(job)
        (run.path / "job_metrics.json").write_text(json.dumps(job, indent=1, default=str))
    return {"summary": rows, "job": job, "records": str(run.writer.path)}


def bench_vs_best_fixed(job: dict[str, Any], plan: Plan, records: list[dict]) -> dict[str, Any]:
    """experiment=bench: a method over several arms against the best of the one-arm methods
    that play those arms alone in the same job (``Plan.named_alone``: same runtime and planner),
    as ``<method>/vs_best_fixed`` and ``/best_fixed``, where every one of its arms has one, with
    ``/vs_best_fixed_p05`` and ``_p95``: its 90 % bootstrap interval over the job's batches of
    prompts (``vs_best_interval``; None with a single batch)."""
    out: dict[str, Any] = {}
    for name, alone in plan.named_alone.items():
        fixed = [alone.get(i) for i in range(len(plan.named_arms[name]))]
        if None in fixed or job.get(f"{name}/tps") is None \
                or any(job.get(f"{f}/tps") is None for f in fixed):
            continue
        best = max(fixed, key=lambda f: job[f"{f}/tps"])
        out[f"{name}/vs_best_fixed"] = job[f"{name}/tps"] / job[f"{best}/tps"]
        out[f"{name}/best_fixed"] = best
        lo, hi = vs_best_interval(records, name, fixed) or (None, None)
        out[f"{name}/vs_best_fixed_p05"], out[f"{name}/vs_best_fixed_p95"] = lo, hi
    return out


def policy_methods(plan: Plan) -> dict[str, dict[int, str]]:
    """Every learning method of the job -> its arms played alone (arm index -> method)."""
    out = {m: plan.arms for m in ([plan.spec] if plan.spec else []) + plan.extra if plan.arms}
    out.update({m: alone for m, alone in plan.named_alone.items()
                if len(plan.named_arms.get(m, ())) > 1 and alone})
    return out


def job_metrics(records: list[dict], plan: Plan, target, iters: int) -> tuple[dict[str, Any], list[float]]:
    """The papers' quantities of one job under flat keys (identical across jobs of a sweep):
    ``<role>/{alpha,tau,tps,decode_tps,speedup,step_p50_s,step_p99_s}`` for ar, spec,
    ref_full_head, each arm (``arm/<name>/...``), extra policies, HF baselines and bench
    methods (``<method>/...``, with ``speedup_pooled``: pooled TPS over AR's), a policy's
    ``step_overhead`` and ``priced_vs_best_fixed`` (:func:`flashspec.metrics.step_overhead`,
    :func:`~flashspec.metrics.priced_rate`); ``rho_tau``,
    ``nu``, ``kappa``, ``rho_tps_pred``, ``rho_tps_meas``; ``regret/final`` and the per-step
    series; ``arm_picks/<arm>``; the head's rank and size."""
    ar = method_records(records, "ar")
    job: dict[str, Any] = {}
    for method, role in plan.roles().items():
        recs = method_records(records, method)
        if recs:
            job.update({f"{role}/{k}": v for k, v in decode_stats(recs, ar).items() if v is not None})
    ar_tps = job.get("ar/tps")
    for name in plan.named:   # the bench's ratio: pooled tokens per second over AR's
        if ar_tps and job.get(f"{name}/tps") is not None:
            job[f"{name}/speedup_pooled"] = job[f"{name}/tps"] / ar_tps
    job.update(bench_vs_best_fixed(job, plan, records))
    roles, tps = plan.roles(), pooled_tps(records)
    for method, alone in policy_methods(plan).items():
        role = roles.get(method, method)
        cost = step_overhead(records, method, alone)
        if cost is not None:
            job[f"{role}/step_overhead"], job[f"{role}/step_overhead_prompts"] = cost
        priced = priced_rate(records, method, alone)
        best = max((tps[m] for m in alone.values() if m in tps), default=None)
        if priced is not None and best:
            job[f"{role}/priced_vs_best_fixed"] = priced / best
    regret: list[float] = []
    if plan.spec and plan.arms:
        means = arm_mean_rewards(records, plan.arm_names)
        spec = method_records(records, plan.spec)
        regret = policy_regret(records, plan.spec, plan.arm_names)   # what the notebooks redraw
        job["regret/final"] = regret[-1] if regret else 0.0
        job.update({f"arm_picks/{name}": n for name, n in
                    zip(plan.arm_names, pick_counts(spec, len(plan.arm_names)))})
        job.update({f"arm_mean_reward/{name}": m for name, m in zip(plan.arm_names, means)
                    if m is not None})
    if plan.full_head and plan.heads is not None:
        variant, full = method_records(records, plan.variant), method_records(records, plan.full_head)
        tau_v, tau_f = decode_stats(variant)["tau"], decode_stats(full)["tau"]
        lat_v, lat_f = (head_latency(h, target.shape.hidden_size, target.device, target.dtype, iters)
                        for h in plan.heads)
        steps = sum(r["steps"] for r in full)
        step_s = sum(r["decode_s"] for r in full) / steps if steps else None
        if tau_v and tau_f and step_s:
            job["rho_tau"] = tau_v / tau_f
            job["rho_tau_reference"] = plan.reference   # twin | backbone
            job["nu"] = lat_v / lat_f
            job["kappa"] = kappa(plan.gamma, lat_f, step_s)
            job["rho_tps_pred"] = rho_tps(job["rho_tau"], job["nu"], job["kappa"])
            job["rho_tps_meas"] = decode_stats(variant)["decode_tps"] / decode_stats(full)["decode_tps"]
        job.update({f"head/{k}": v for k, v in plan.head.items() if v is not None})
    return job, regret


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _order(methods: list[Method], batch_id: int, rotate: bool) -> list[Method]:
    """Method order for one batch: rotated by the batch index so that no method always runs
    first (on an H200 the method run right after the slow HF eager baselines was ~15-25 %
    slower than the identical engine run later in the same batch)."""
    k = batch_id % len(methods) if rotate else 0
    return methods[k:] + methods[:k]


def _stream_figure(records: list[dict], cfg: DictConfig, out_dir: Path) -> None:
    """``stream.png``: arm chosen per step against the prompt's domain, for bandit methods."""
    if not any(r.get("method", "").startswith("spec:bandit") for r in records):
        return
    import matplotlib
    matplotlib.use("Agg")
    from flashspec.analysis.bandit_stream_plot import plot_stream
    from experiments.harness import arm_names
    plot_stream(records, arm_names(cfg.drafters),
                out_dir / "stream.png")
    log.info("figure: %s", out_dir / "stream.png")


def _decode_batch(method: Method, batch: list[Prompt], batch_id: int, tokenizer, max_new: int,
                  params: SamplingParams, run: RunDir, done: set, role: str | None = None) -> None:
    """All turns of one batch of prompts with one method (turn 2 follows the method's own answer)."""
    if all((method.name, p.id, t) in done for p in batch for t in range(len(p.turns))):
        return
    answers: dict[str, list[str]] = {p.id: [] for p in batch}
    for turn in range(max(len(p.turns) for p in batch)):
        rows = [p for p in batch if len(p.turns) > turn]
        ids = [prompt_turn_ids(tokenizer, p, answers[p.id]) for p in rows]
        seed = derive_seed(run.seed, (method.name, tuple(p.id for p in rows), turn))
        stats = method.run(ids, max_new, rows[0].domain, seed)
        for p, prompt_ids, st in zip(rows, ids, stats):
            text = tokenizer.decode(st["tokens"], skip_special_tokens=True)
            answers[p.id].append(text)
            if (method.name, p.id, turn) in done:
                continue
            rec = _record(method.name, p, turn, prompt_ids, st, text, batch_id, len(rows), params)
            run.write(rec)
            run.logger.log({f"prompt/{role or method.name}/{k}": rec[k]
                            for k in ("tps", "alpha", "tau") if rec[k] is not None})


def _record(method: str, p: Prompt, turn: int, prompt_ids: list[int], st: dict, text: str,
            batch_id: int, batch_size: int, params: SamplingParams) -> dict[str, Any]:
    n_new = len(st["tokens"])
    steps = st["steps"]
    rate = rates(st["n_accepted"], st["n_proposed"], steps)
    return DecodeRecord(
        method=method, dataset=p.dataset, prompt_id=p.id, domain=p.domain, category=p.category,
        turn=turn, n_prompt_tokens=len(prompt_ids), n_new_tokens=n_new, wall_s=st["wall_s"],
        decode_s=st["decode_s"], tps=n_new / st["wall_s"] if st["wall_s"] else None,
        decode_tps=n_new / st["decode_s"] if st["decode_s"] else None, steps=steps,
        n_proposed=st["n_proposed"], n_accepted=st["n_accepted"], alpha=rate["alpha"],
        tau=rate["tau"], accept_hist=st["accept_hist"], arms=st["arms"], rewards=st["rewards"],
        step_p50_s=st.get("step_p50_s"), step_p99_s=st.get("step_p99_s"),
        capture_s=st.get("capture_s", 0.0), head_s=st.get("head_s"), head_calls=st.get("head_calls"),
        gamma=max(len(st["accept_hist"]) - 1, 0), batch_size=batch_size,
        batch_id=f"{method}:{batch_id}:{turn}", temperature=params.temperature,
        tokens=st["tokens"], text=text).as_dict()
