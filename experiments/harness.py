"""What every runner shares: library objects from the composed config (through
``hydra.utils.instantiate``), the checks made before any model loads, and the run directory
(records, provenance, the logger).

The library never reads a config: each config group that makes an object carries ``_target_``
and this module instantiates it. Groups that need run-time arguments are partials:
``bandit`` (called with n_arms, seed) and each drafter entry (called with a
:class:`~flashspec.drafters.DraftContext` and its name).
"""
from __future__ import annotations

import functools
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from flashspec.bandits import Policy
from flashspec.core import Arm, SamplingParams
from flashspec.data import PromptSet
from flashspec.drafters import DraftContext, Drafter
from flashspec.errors import FlashSpecError
from flashspec.hardware import Hardware
from flashspec.runtime import Runtime
from flashspec.planner import WidthPlanner
from flashspec.data import data_hash
from flashspec.records import (RESUME_MODES, NullLogger, RecordWriter, RunLock, check_resume,
                               config_diff, flatten, provenance, read_records)
from flashspec.verify import get_backend
from experiments.schema import check_config

log = logging.getLogger("flashspec")


def build(node: Any, **kwargs: Any) -> Any:
    """``instantiate(node, **kwargs)``; a FlashSpecError raised inside comes out as itself (one
    line for the user), not wrapped in Hydra's InstantiationException."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        while cause is not None and not isinstance(cause, FlashSpecError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        if isinstance(e.__cause__, TypeError):   # e.g. a setting the target does not take
            raise FlashSpecError(f"{node.get('_target_')}: {e.__cause__}") from None
        raise


# ----------------------------------------------------------------------------- objects
def hardware(cfg: DictConfig) -> Hardware:
    return build(cfg.hardware)


def runtime(cfg: DictConfig) -> Runtime:
    """How the decode loop runs (``runtime=eager|graphed|resident``; each hardware profile
    names its default)."""
    return build(cfg.runtime)


def prompt_set(cfg: DictConfig) -> PromptSet:
    return build(cfg.dataset)


def load_target(cfg: DictConfig):
    """(model, tokenizer) of the target; ``runtime.fused_layers`` swaps the fused decode layers
    in."""
    model, tokenizer = build(cfg.target)
    if runtime(cfg).fused_layers:
        from flashspec.models.fused import fuse_model   # Triton: only when asked for
        fuse_model(model)
    return model, tokenizer


def draft_context(cfg: DictConfig, target, tokenizer) -> DraftContext:
    hw = hardware(cfg)
    return DraftContext(target=target, tokenizer=tokenizer, device=hw.device, dtype=hw.dtype,
                        kernels=runtime(cfg).kernels)


# A drafter entry's option that its builder does not take: the checkpoint of the drafter's
# full-head twin (experiment=train_drafter experiment.heads=[...]), which experiment=decode's
# ρ_τ reference decodes with instead of the drafter's own backbone under the full head.
TWIN = "twin"


def drafter_builder(entry: DictConfig):
    """The entry's builder, a partial called with ctx and name (and any override), without the
    entry's ``twin`` option."""
    make = build(entry, _partial_=True)
    return functools.partial(make.func, *make.args,
                             **{k: v for k, v in make.keywords.items() if k != TWIN})


def build_drafters(cfg_drafters: DictConfig, ctx: DraftContext) -> dict[str, Drafter]:
    """Every drafter of the set, by name (each entry is a partial called with ctx and name)."""
    out: dict[str, Drafter] = {}
    for name, entry in (cfg_drafters.get("drafters") or {}).items():
        out[name] = drafter_builder(entry)(ctx=ctx, name=name)
    return out


def config_arms(cfg_drafters: Mapping[str, Any]) -> list[Arm]:
    """The arms of a drafter set, in the policy's index order: the explicit ``arms`` list
    (``[drafter, γ]``, ``[drafter, tree]`` with a tree written as in
    :meth:`flashspec.core.TreeShape.parse`: ``4x2x1``, ``dyn15``; ``[ar, 0]``: no
    speculation), or every drafter × every γ. Read from the config alone (no drafter built)."""
    pairs = cfg_drafters.get("arms")
    if pairs is None:
        pairs = [(name, g) for name in (cfg_drafters.get("drafters") or {})
                 for g in cfg_drafters.get("gammas", [4])]
    out = []
    for pair in pairs:
        if isinstance(pair, str):   # a label reads as one, but a config pair is the form here
            raise FlashSpecError(f"drafters.arms: {pair!r} is not a [drafter, gamma or tree] pair")
        try:
            out.append(Arm.parse(list(pair)))
        except FlashSpecError as e:
            raise FlashSpecError(f"drafters.arms: {e}") from None
    return out


def arm_names(cfg_drafters: Mapping[str, Any]) -> list[str]:
    """The labels of the arms :func:`build_arms` builds, in the policy's index order, from the
    config alone: what a job's records and metrics call them."""
    return [a.label for a in config_arms(cfg_drafters)]


def build_arms(cfg_drafters: Mapping[str, Any], drafters: Mapping[str, Drafter]) -> list[Arm]:
    """The arms of the drafter set (:func:`config_arms`), each naming a drafter of ``drafters``
    that can draft it (a tree arm: a drafter that drafts trees)."""
    arms = config_arms(cfg_drafters)
    for arm in arms:
        if arm.drafter is not None and arm.drafter not in drafters:
            raise FlashSpecError(f"drafters.arms names drafter {arm.drafter!r}, not in the "
                                 f"drafter set {list(drafters)}")
        if arm.tree is not None:
            if not drafters[arm.drafter].tree:
                raise FlashSpecError(f"drafters.arms gives drafter {arm.drafter!r} the tree "
                                     f"{arm.tree.label}; it drafts chains only (trees: EAGLE and "
                                     "n-gram drafters)")
            drafters[arm.drafter].check_tree(arm.tree)
    return arms


def make_policy(cfg_bandit: DictConfig, n_arms: int, seed: int) -> Policy:
    """The bandit node's policy; ``cold: true`` in the node keeps it from stored priors (a cold
    twin of a warm policy in the same run, labelled ``.../cold``)."""
    node = OmegaConf.masked_copy(cfg_bandit, [k for k in cfg_bandit if k != "cold"]) \
        if "cold" in cfg_bandit else cfg_bandit
    policy = build(node)(n_arms=n_arms, seed=seed)
    policy.cold = bool(cfg_bandit.get("cold", False))
    return policy


def make_planner(cfg: DictConfig) -> WidthPlanner | None:
    """The width planner, or None for ``planner=none`` (an empty group)."""
    node = cfg.get("planner")
    return build(node) if node and "_target_" in node else None


CONF = Path(__file__).resolve().parents[1] / "conf"


def group_node(cfg: DictConfig, group: str, choice: Any) -> DictConfig | None:
    """A bench method's own choice in a config group: None keeps the run's; a name loads that
    option's file (``runtime: eager``, ``planner: goodput``, ``bandit: thompson``: the files the
    command line picks from); a mapping with ``_target_`` is the node itself, one without it is
    merged onto the run's node (``runtime: {resident_chunk: 4}``)."""
    if choice is None:
        return cfg.get(group)
    if isinstance(choice, str):
        path = CONF / group / f"{choice}.yaml"
        if not path.is_file():
            options = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
            raise FlashSpecError(f"{group}={choice}: no conf/{group}/{choice}.yaml; options: "
                                 f"{', '.join(options)}")
        node = OmegaConf.load(path)
        if "defaults" in node:   # a file that composes others needs Hydra, not a plain load
            raise FlashSpecError(f"conf/{group}/{choice}.yaml has a defaults list; a bench "
                                 "method names only plain options of a group")
        return node
    if "_target_" in choice:
        return choice
    return OmegaConf.merge(cfg.get(group) or {}, choice)


@dataclass
class BenchMethod:
    """One method of experiment=bench built from its entry: arms (from the config alone), the
    runtime its engine runs, its policy (None: a single arm played alone) and planner."""

    arms: list[Arm]
    runtime: Runtime
    policy: Policy | None
    planner: WidthPlanner | None


BENCH_METHOD_KEYS = ("arms", "runtime", "bandit", "planner")


def bench_specs(cfg: DictConfig) -> dict[str, DictConfig]:
    """experiment=bench's method entries by name, those set to null left out
    (``experiment.methods.tree_planner=null``); ``ar``, the reference of every speedup and
    greedy_equal, must be among them."""
    specs = {str(k): v for k, v in cfg.experiment.methods.items() if v is not None}
    if "ar" not in specs:
        raise FlashSpecError("experiment=bench needs a method named ar (the reference of every "
                             f"speedup and greedy_equal); methods: {list(specs)}")
    return specs


def bench_method(cfg: DictConfig, name: str, spec: Mapping[str, Any]) -> BenchMethod:
    """``experiment.methods.<name>``: ``arms`` (pairs as in ``drafters.arms``: ``[[ar, 0]]``,
    ``[[eagle_v5, 4]]``, ``[[eagle_v5, dyn15d6k4]]``), and optionally ``runtime`` (default:
    the run's), ``bandit`` (default: the run's when there are several arms) and ``planner``
    (default: none), each a group option's name or a node (:func:`group_node`). Built at
    composition too (:func:`validate`), so a bad entry fails before any model loads."""
    where = f"experiment.methods.{name}"
    if not isinstance(spec, (Mapping, DictConfig)) or "arms" not in spec \
            or set(spec) - set(BENCH_METHOD_KEYS):
        got = sorted(spec) if isinstance(spec, (Mapping, DictConfig)) else spec
        raise FlashSpecError(f"{where}: give arms and optionally runtime, bandit, planner; "
                             f"got {got!r}")
    try:
        arms = config_arms({"arms": spec["arms"]})
        names = list(cfg.drafters.get("drafters") or {}) if "drafters" in cfg else []
        for arm in arms:
            if arm.drafter is not None and arm.drafter not in names:
                raise FlashSpecError(f"arm {arm.label} names drafter {arm.drafter!r}, not in "
                                     f"the drafter set {names}")
        rt = build(group_node(cfg, "runtime", spec.get("runtime")))
        policy = None
        if len(arms) > 1 or spec.get("bandit") is not None:
            policy = make_policy(group_node(cfg, "bandit", spec.get("bandit")), len(arms),
                                 int(cfg.seed))
        node = group_node(cfg, "planner", spec.get("planner") or "none")
        planner = build(node) if node and "_target_" in node else None
    except FlashSpecError as e:
        raise FlashSpecError(f"{where}: {e}") from None
    return BenchMethod(arms, rt, policy, planner)


def engine_options(cfg: DictConfig, params, eos: list[int], rt: Runtime | None = None
                   ) -> dict[str, Any]:
    """SpecEngine keyword arguments shared by every method of a run; ``rt``: a method's own
    runtime in place of the run's (experiment=bench: an eager or graphed AR beside the resident
    one on the same target)."""
    rt = rt or runtime(cfg)
    return dict(params=params, backend=get_backend(rt.verify_backend, rt.kernels),
                seed=int(cfg.seed), eos_ids=eos, graphs=rt.cuda_graphs,
                resident=rt.resident_loop, chunk=rt.resident_chunk)


# ----------------------------------------------------------------------------- checks
def takes_head(entry: DictConfig) -> bool:
    """Whether a drafter entry takes the run's ``head`` choice (``head: ${head}``)."""
    return "head" in entry and OmegaConf.is_interpolation(entry, "head")


def head_axis_used(cfg_drafters: DictConfig) -> bool:
    """Whether some drafter of the set takes the run's ``head`` choice."""
    return any(takes_head(e) for e in (cfg_drafters.get("drafters") or {}).values())


def validate(cfg: DictConfig, overrides: list[str] = ()) -> None:
    """Checks made at composition, before any model loads: every value a runner reads is of its
    declared type and range (:mod:`experiments.schema`; no runner casts 2.5 to 2), every cheap
    object is built once (contradictions inside a group fail there), and settings a chosen
    component would ignore are refused. ``overrides`` are the command line's (``head=...``,
    ``head.rank=...``)."""
    check_config(cfg)
    hw = hardware(cfg)
    if "runtime" in cfg:
        rt = runtime(cfg)
        if (rt.cuda_graphs or rt.resident_loop) and not hw.device.startswith("cuda"):
            # allowed, as cuda_graphs on a CPU always was: the same code paths run uncaptured
            # (how the CPU tests check them); one line says so rather than an error
            log.warning("runtime=%s on hardware=%s: no CUDA graphs off CUDA, so its steps run "
                        "uncaptured", rt.name, hw.name)
    exp = cfg.get("experiment") or {}
    if "temperature" in exp:   # the sampling settings' own rules (T = 0 or >= T_MIN, ...)
        try:
            SamplingParams(float(exp.temperature), int(exp.get("top_k", 0)),
                           float(exp.get("top_p", 1.0)))
        except FlashSpecError as e:   # "temperature must be ..." -> "experiment.temperature ..."
            raise FlashSpecError(f"experiment.{e}") from None
    if cfg.get("resume", "check") not in RESUME_MODES:
        raise FlashSpecError(f"resume={cfg.resume}; choose one of {', '.join(RESUME_MODES)}")
    if "dataset" in cfg:
        prompt_set(cfg)
    if "head" in cfg:
        build(cfg.head)
        head_keys = [o for o in overrides if o.lstrip("+~").split("=")[0].split("@")[0] == "head"
                     or o.lstrip("+~").startswith("head.")]
        if head_keys and "drafters" in cfg and not head_axis_used(cfg.drafters):
            names = ", ".join(cfg.drafters.get("drafters") or {}) or "none"
            raise FlashSpecError(f"{' '.join(head_keys)} has no effect: no drafter of this "
                                 f"drafter set ({names}) takes the head choice (drafter entries "
                                 "with `head: ${head}` do); pick a set that has one (the "
                                 "target's own, drafters=<target>) or drop it")
    if "bandit" in cfg and "drafters" in cfg:
        make_policy(cfg.bandit, max(1, len(config_arms(cfg.drafters))), int(cfg.seed))
    make_planner(cfg)
    if isinstance(exp.get("methods"), DictConfig):   # experiment=bench: each method built once
        for name, spec in bench_specs(cfg).items():
            bench_method(cfg, name, spec)


# ----------------------------------------------------------------------------- the run directory
def job_info(cfg: DictConfig) -> dict[str, Any]:
    """What identifies this job among its sweep: the sweep (or run) folder as the W&B group,
    the command-line overrides as swept values, the group choices as tags, and a run name."""
    from hydra.core.hydra_config import HydraConfig
    out_dir = Path(cfg.output_dir)
    info: dict[str, Any] = {"group": out_dir.name, "swept": {}, "choices": {}, "name": out_dir.name}
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            sweep = Path(hc.sweep.dir)
            info["group"] = f"{sweep.parent.name}_{sweep.name}"
        info["swept"] = dict(o.split("=", 1) for o in hc.overrides.task if "=" in o
                             and not o.split("=", 1)[0].lstrip("+~").startswith(("hydra", "output_dir")))
        info["choices"] = {k: v for k, v in hc.runtime.choices.items()
                           if not k.startswith("hydra") and v is not None}
        info["name"] = hc.job.override_dirname or "default"
    if cfg.get("smoke"):
        info["name"] = f"smoke-{info['name']}"
    return info


def _wandb_id(path: Path) -> str:
    """This run directory's W&B run id (made once, kept in the directory: a resumed run
    continues the same W&B run)."""
    import secrets
    file = path / "wandb_run_id"
    if not file.exists():
        file.write_text(secrets.token_hex(8))
    return file.read_text().strip()


class RunDir:
    """One run's directory, held by one process (a lock naming its pid): tied to one config
    (``resume=check`` refuses a directory whose stored config differs, naming the keys;
    ``resume=accept`` continues with the new one, ``resume=fresh`` archives the old run), a
    record writer, the provenance every record carries (config and prompt-data hashes), and the
    logger (a W&B run that a resumed directory continues, or the do-nothing logger)."""

    def __init__(self, cfg: DictConfig, records: str, extra_config: Mapping[str, Any] | None = None,
                 data: str | None = None) -> None:
        self.path = Path(cfg.output_dir)
        self.seed = int(cfg.seed)
        self.path.mkdir(parents=True, exist_ok=True)
        self.config = OmegaConf.to_container(cfg, resolve=True)
        source = str(cfg.dataset.get("source", "local")) if "dataset" in cfg else "local"
        self.data_hash = data_hash(data, source) if data else None
        self.lock = RunLock(self.path).acquire()
        try:
            self.resume = _check_resume(self.path, self.config, str(cfg.get("resume", "check")),
                                        self.data_hash)
        except BaseException:
            self.lock.release()
            raise
        self.writer = RecordWriter(self.path / records)
        self.provenance = provenance(self.config, int(cfg.seed), data_hash=self.data_hash)
        self.info = job_info(cfg)
        self.logger = NullLogger()
        if "logger" in cfg:
            lg = cfg.logger
            tags = [*(lg.get("tags") or []), *(f"{k}={v}" for k, v in self.info["choices"].items()),
                    *(["smoke"] if cfg.get("smoke") else [])]
            config = {**self.config, "swept": self.info["swept"], **(extra_config or {})}
            kwargs = dict(config=config, name=self.info["name"], dir=str(self.path))
            if "group" in lg:   # a W&B logger: sweep group, experiment as job type, resumable
                kwargs.update(group=lg.group or self.info["group"], tags=tags,
                              job_type=str(cfg.experiment.name), id=_wandb_id(self.path))
            self.logger = build(lg, _partial_=True)(**kwargs)

    def done_keys(self, *fields: str) -> set[tuple]:
        """Keys (tuple of ``fields``) of the records already here, which the run keeps and does
        not redo; what they are is logged (how many, and for those written under another config
        or other prompt data, how that differs from this run's)."""
        records = list(read_records(self.writer.path, required=fields))
        for line in self.kept(records):
            log.info("%s", line)
        return {tuple(r[k] for k in fields) for r in records}

    def kept(self, records: list[dict[str, Any]]) -> list[str]:
        """One line per group of ``records`` (by the config and prompt data that wrote them):
        how many are kept, and where their config or data differ from this run's."""
        groups: dict[tuple, list[dict]] = {}
        for r in records:
            prov = r.get("provenance") if isinstance(r.get("provenance"), dict) else {}
            groups.setdefault((prov.get("config_hash"), prov.get("data_hash")), []).append(r)
        lines = []
        for (digest, data), recs in groups.items():
            where = f"{len(recs)} record(s) already in {self.writer.path.name}"
            if digest is None:
                lines.append(f"keeping {where} without provenance (config unknown); not "
                             "decoded again")
                continue
            if digest == self.provenance["config_hash"] and data == self.data_hash:
                lines.append(f"keeping {where}, written under this config; not decoded again")
                continue
            old = recs[0]["provenance"].get("config") or {}
            new, then = flatten(self.config), flatten(old)
            keys = config_diff(old, self.config)
            diffs = [f"{k}={_show(then, k)} (now {_show(new, k)})" for k in keys[:8]]
            if len(keys) > 8:
                diffs.append(f"{len(keys) - 8} more keys (run_config_history.jsonl)")
            if data != self.data_hash:
                diffs.append(f"prompt data {str(data)[:12]} (now {str(self.data_hash)[:12]})")
            lines.append(f"keeping {where}, written under {'; '.join(diffs) or 'another config'}: "
                         "they are not decoded again (resume=fresh moves them aside and redoes "
                         "them)")
        return lines

    def write(self, record: dict[str, Any]) -> None:
        self.writer.write({**record, "provenance": self.provenance})


def _show(flat: Mapping[str, Any], key: str) -> str:
    return str(flat[key]) if key in flat else "absent"


def _check_resume(path: Path, config: dict, mode: str, data: str | None = None):
    """``check_resume``, keeping ``.hydra/`` describing the records: Hydra rewrites it at every
    start, so the copy taken when the directory's config was last accepted is put back when a
    different config is refused."""
    import shutil
    hydra_dir, kept = path / ".hydra", path / ".hydra.accepted"
    try:
        info = check_resume(path, config, mode, data_hash=data)
    except FlashSpecError:
        if kept.is_dir() and hydra_dir.is_dir():
            shutil.rmtree(hydra_dir)
            shutil.copytree(kept, hydra_dir)
        raise
    if hydra_dir.is_dir():
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(hydra_dir, kept)
    if info.status != "new":
        log.info("run directory %s: %s (config %s)%s", path, info.status, info.config_hash[:12],
                 f"; changed: {', '.join(info.changed)}" if info.changed else "")
    return info


@contextmanager
def run_dir(cfg: DictConfig, records: str, extra_config: Mapping[str, Any] | None = None,
            data: str | None = None) -> Iterator[RunDir]:
    """A :class:`RunDir` whose logger is finished and lock released however the run ends."""
    run = RunDir(cfg, records, extra_config, data)
    try:
        yield run
    finally:
        try:
            run.logger.finish()
        finally:
            run.lock.release()
