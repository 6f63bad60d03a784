"""Run records: JSONL files flushed per record, provenance and hashes, the run-directory lock and
resume check, and a thin W&B wrapper."""
from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import platform
import socket
import subprocess
import time
from dataclasses import dataclass, field, fields
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar, Iterator, Mapping, Sequence

import torch

from flashspec.errors import FlashSpecError
from flashspec.paths import write_text_atomic

log = logging.getLogger(__name__)

_PACKAGES = ("torch", "triton", "transformers", "hydra-core", "wandb", "flashspec")
RUN_CONFIG = "run_config.json"
RUN_CONFIG_HISTORY = "run_config_history.jsonl"
LOCK_NAME = ".flashspec.lock"
ARCHIVE_PREFIX = "previous-"
QUARANTINE_SUFFIX = ".torn"   # where lines that are not records go: <records file>.torn
RESUME_MODES = ("check", "accept", "fresh")
# Dotted config keys that may differ between two invocations of one run without changing its
# results: where it writes, Hydra's own settings, where it logs, and the resume mode itself.
IGNORED_KEYS = ("output_dir", "hydra", "logger", "resume")


def git_commit() -> str:
    """Current commit of the repository holding this package ('unknown' outside git)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def hardware() -> dict[str, Any]:
    """What the run executed on."""
    info: dict[str, Any] = {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                            "machine": platform.machine()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def versions() -> dict[str, str]:
    """Installed versions of the libraries that shape results."""
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def canonical_json(obj: Any) -> str:
    """One deterministic JSON text for ``obj``: sorted keys, no spaces, str keys."""
    return json.dumps(_str_keys(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=_jsonable)


def config_hash(config: Mapping[str, Any] | None, ignore: Sequence[str] = IGNORED_KEYS) -> str:
    """sha256 (hex) of the canonical JSON of ``config`` minus the ``ignore`` dotted keys (and
    everything under them): two runs of one experiment in two run directories hash alike.
    ``ignore=()`` hashes every key."""
    return hashlib.sha256(canonical_json(_without(config or {}, ignore)).encode()).hexdigest()


def provenance(config: Mapping[str, Any] | None = None, seed: int | None = None,
               data_hash: str | None = None) -> dict[str, Any]:
    """Provenance block carried by every record: commit, hardware, library versions, seed, the
    resolved config and its ``config_hash``, and the prompt data's hash (``flashspec.data.
    data_hash``; None when the run reads no prompt files)."""
    return {"commit": git_commit(), "hardware": hardware(), "versions": versions(),
            "seed": seed, "config": config,
            "config_hash": config_hash(config) if config is not None else None,
            "data_hash": data_hash}


class RecordWriter:
    """Append-only JSONL writer; each record is one line, flushed and fsynced as it is written.

    The file always ends on a line boundary before a record is appended: a torn last line (a
    crash mid-write) is moved to ``<file>.torn`` with a warning (a complete record that only
    lacks its newline is kept), so a new record never lands on a broken line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair_tail(self.path)
        quarantine_lines(self.path)

    def write(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, default=_jsonable) + "\n").encode()
        repair_tail(self.path)
        with self.path.open("ab") as f:
            start = f.tell()
            try:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            except BaseException:
                f.truncate(start)   # never leave half a record behind (e.g. disk full)
                raise

    def done_keys(self, *fields: str) -> set[tuple]:
        """Keys (tuple of ``fields``) of complete records already on disk, for resuming (a
        record without one of them is reported and not counted: its work is done again)."""
        return {tuple(r[k] for k in fields) for r in read_records(self.path, required=fields)}


def repair_tail(path: str | Path) -> bool:
    """Make ``path`` end on a newline; returns whether anything had to be repaired.

    A last line without its newline that parses as a JSON object is a complete record: the
    newline is added. Anything else is a torn record: it is appended to ``<path>.torn`` (the
    quarantine, :data:`QUARANTINE_SUFFIX`) and cut
    from the file. Both cases are logged with the file and line number."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return False
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return False
        f.seek(0)
        data = f.read()
        cut = data.rfind(b"\n") + 1
        tail, lineno = data[cut:], data.count(b"\n", 0, cut) + 1
        if _is_record(tail):
            f.seek(size)
            f.write(b"\n")
            log.warning("%s line %d: complete record without its newline (interrupted write); "
                        "newline added", path, lineno)
        else:
            quarantine = path.with_name(path.name + QUARANTINE_SUFFIX)
            with quarantine.open("ab") as q:
                q.write(tail + b"\n")
            f.truncate(cut)
            log.warning("%s line %d: torn record (%d bytes, interrupted write) moved to %s",
                        path, lineno, len(tail), quarantine)
        f.flush()
        os.fsync(f.fileno())
    return True


@dataclass(frozen=True)
class DecodeRecord:
    """One decode record: one prompt (turn) decoded by one method. The one schema of the decode
    records every decoding experiment writes (decode, bench, mixed_stream, head_decode), that
    :func:`read_records` checks, ``scripts/collect.py`` orders its columns by and the notebooks
    read through collect. ``as_dict`` is what goes on disk (a record's provenance is added by
    the run directory's writer)."""

    method: str
    dataset: str
    prompt_id: str
    domain: str | None
    category: str | None
    turn: int
    n_prompt_tokens: int
    n_new_tokens: int
    wall_s: float
    decode_s: float
    tps: float | None
    decode_tps: float | None
    steps: int
    n_proposed: int
    n_accepted: int
    alpha: float | None          # accepted / proposed drafts (None: nothing proposed)
    tau: float | None            # tokens per step
    accept_hist: list[int]       # steps by accepted drafts: [0 accepted, 1, ..., gamma]
    arms: list[int]              # the arm index each step played
    rewards: list[float]         # the policy's reward of each step it learned from
    step_p50_s: float | None
    step_p99_s: float | None
    capture_s: float
    gamma: int                   # longest draft of the method (len(accept_hist) - 1)
    batch_size: int
    batch_id: str                # method:batch:turn (records decoded in one generate call)
    temperature: float
    tokens: list[int]
    text: str
    head_s: float | None = None  # experiment=head_decode's in-loop head stopwatch (eager only)
    head_calls: int | None = None
    experiment: str = "decode"

    IDENTITY: ClassVar[tuple[str, ...]] = ("method", "dataset", "prompt_id", "turn")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and "None" not in str(f.type):
                raise FlashSpecError(f"decode record: {f.name} is None")
        if not 0 <= self.n_accepted <= self.n_proposed:
            raise FlashSpecError(f"decode record {self.method}/{self.prompt_id}: accepted "
                                 f"{self.n_accepted} of {self.n_proposed} proposed")
        if len(self.tokens) != self.n_new_tokens:
            raise FlashSpecError(f"decode record {self.method}/{self.prompt_id}: "
                                 f"{len(self.tokens)} tokens, n_new_tokens {self.n_new_tokens}")

    @classmethod
    def columns(cls) -> list[str]:
        """Field names in schema order (``experiment`` first, as tables show it)."""
        names = [f.name for f in fields(cls)]
        return ["experiment", *[n for n in names if n != "experiment"]]

    def as_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.columns()}
        return {k: v for k, v in out.items() if v is not None or k not in ("head_s", "head_calls")}


# Fields without which a record of an experiment cannot be used (grouped by method, paired with
# its AR record, skipped on resume): such a record is reported and left out, never pooled into a
# nameless row.
RECORD_FIELDS: dict[str, tuple[str, ...]] = {"decode": DecodeRecord.IDENTITY}


def read_records(path: str | Path, required: Sequence[str] = (),
                 experiment: str | None = None) -> Iterator[dict[str, Any]]:
    """Records of a JSONL file: the one reader of run records (resume, summaries,
    scripts/collect.py). A line that is not a usable record is reported (file and line number,
    one line) and skipped, never dropped silently nor raised: bytes that are not UTF-8, text
    that is not one JSON object, a record without the ``required`` fields or without those its
    experiment's records carry (:data:`RECORD_FIELDS`, by its own ``experiment`` field or else
    the ``experiment`` given). A torn record followed by a whole one on the same line (an old
    writer appended after a crash) yields the whole one. A ``.gz`` file is read through gzip
    (committed records too large to keep raw)."""
    path = Path(path)
    if not path.exists():
        return
    with (gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")) as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            record, problem = parse_line(raw)
            if record is None:
                log.warning("%s line %d: %s; skipped", path, lineno, problem)
                continue
            if problem:
                log.warning("%s line %d: %s", path, lineno, problem)
            fields = (*required, *RECORD_FIELDS.get(str(record.get("experiment", experiment)), ()))
            missing = [k for k in dict.fromkeys(fields) if k not in record]
            if missing:
                log.warning("%s line %d: record without %s; skipped", path, lineno,
                            ", ".join(missing))
                continue
            yield record


def parse_line(raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """(record, None) for a line holding one JSON object; (None, why) for a line that holds
    none; (record, note) for a torn record merged with a whole one (the whole one is kept)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r})"
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        record = _trailing_record(line)
        if record is None:
            return None, "not a JSON record (torn write?)"
        return record, ("a torn record merged with the next one; the torn part is skipped, "
                        "the record after it kept")
    if not isinstance(record, dict):
        return None, f"JSON {type(record).__name__}, not a record"
    return record, None


def quarantine_lines(path: str | Path) -> int:
    """Move every line of ``path`` that holds no record (not UTF-8, not a JSON object) to
    ``<path>.torn``, as :func:`repair_tail` does with a torn last line, so that the file a run
    resumes into holds records only; each is logged with the file and line number. The file is
    rewritten atomically, and only when something is moved. Returns the number of lines moved."""
    path = Path(path)
    if not path.is_file() or path.suffix == ".gz":
        return 0
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    bad = []
    for lineno, raw in enumerate(lines, 1):
        record, problem = parse_line(raw) if raw.strip() else ({}, None)
        if record is None:
            bad.append(lineno)
            log.warning("%s line %d: %s; moved to %s", path, lineno, problem,
                        path.name + QUARANTINE_SUFFIX)
    if not bad:
        return 0
    gone = set(bad)
    with path.with_name(path.name + QUARANTINE_SUFFIX).open("ab") as q:
        q.write(b"".join(lines[i - 1].rstrip(b"\n") + b"\n" for i in bad))
        q.flush()
        os.fsync(q.fileno())
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(b"".join(raw for i, raw in enumerate(lines, 1) if i not in gone))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(bad)


def _is_record(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False


def _trailing_record(line: str) -> dict[str, Any] | None:
    """The JSON object that ends ``line`` after a torn prefix, if there is one."""
    text = line.rstrip()
    decoder = json.JSONDecoder()
    start = text.find("{", 1)
    while start != -1:
        try:
            obj, end = decoder.raw_decode(text, start)
            if end == len(text) and isinstance(obj, dict):
                return obj
        except json.JSONDecodeError:
            pass
        start = text.find("{", start + 1)
    return None


def _str_keys(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _str_keys(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_str_keys(v) for v in obj]
    return obj


def _jsonable(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x)}")


# ---------------------------------------------------------------------------------- run directory
def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists are leaves; an empty mapping is a leaf)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def config_diff(old: Mapping[str, Any], new: Mapping[str, Any],
                ignore: Sequence[str] = IGNORED_KEYS) -> list[str]:
    """Dotted keys whose values differ (added or removed keys included), ``ignore``d ones left
    out."""
    a, b = flatten(_without(old, ignore)), flatten(_without(new, ignore))
    return sorted(k for k in a.keys() | b.keys()
                  if k not in a or k not in b or canonical_json(a[k]) != canonical_json(b[k]))


def _without(config: Mapping[str, Any], ignore: Sequence[str]) -> dict[str, Any]:
    """``config`` without the dotted keys in ``ignore`` (nor anything under them)."""
    def keep(mapping: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        out = {}
        for key, value in mapping.items():
            name = f"{prefix}{key}"
            if name in ignore:
                continue
            out[key] = keep(value, name + ".") if isinstance(value, Mapping) else value
        return out
    return keep(_str_keys(config), "")


@dataclass
class ResumeInfo:
    """What ``check_resume`` found and did.

    status: 'new' (first start here), 'same' (stored config and prompt data equal this run's),
    'accepted' (differs in ``changed``, continued on request), 'fresh' (old contents moved to
    ``archived``). ``changed`` names config keys, and ``data_hash`` when the prompt data differ.
    """

    status: str
    config_hash: str
    changed: list[str] = field(default_factory=list)
    archived: Path | None = None


def check_resume(run_dir: str | Path, config: Mapping[str, Any], mode: str = "check",
                 ignore: Sequence[str] = IGNORED_KEYS, data_hash: str | None = None) -> ResumeInfo:
    """Tie ``run_dir`` to one resolved ``config`` (a plain dict) and the hash of the prompt data
    it reads (``flashspec.data.data_hash``; None when it reads none), stored in
    ``run_config.json``.

    On first start both are stored. Later starts compare the config with the stored one, leaving
    out the ``ignore`` keys (cosmetic or per-invocation: output dir, Hydra, logger, the resume
    mode itself), and the data hash (a prompt file edited in place, its manifest updated too,
    changes it while the config stays the same; a directory stored without one is not
    compared). ``mode``:

    - 'check': a difference raises FlashSpecError naming the differing dotted keys, or saying
      that the prompt data changed;
    - 'accept': continue; the new config is stored and the old one appended, with the
      differing keys, to ``run_config_history.jsonl``;
    - 'fresh': everything in the run directory (but the lock, Hydra's ``.hydra`` and ``*.log``
      of the current job, and earlier archives) moves to ``previous-<UTC time>/``; start over.

    A run directory holding records (``*.jsonl``) but no ``run_config.json`` (written before
    this check existed) cannot be checked: 'check' refuses it.
    """
    if mode not in RESUME_MODES:
        raise FlashSpecError(f"resume mode {mode!r}; choose one of {', '.join(RESUME_MODES)}")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    stored_path = run_dir / RUN_CONFIG
    config = _str_keys(config)
    digest = config_hash(config, ignore)
    if mode == "fresh":
        archived = _archive(run_dir)
        _store_config(stored_path, config, digest, data_hash)
        return ResumeInfo("fresh", digest, archived=archived)
    if not stored_path.is_file():
        old_records = sorted(p.name for p in run_dir.glob("*.jsonl"))
        if old_records and mode == "check":
            raise FlashSpecError(
                f"{run_dir} holds records ({', '.join(old_records)}) but no {RUN_CONFIG}, so "
                "nothing says which config wrote them; resume with mode 'accept' to adopt them "
                "for this config, or 'fresh' to move them aside")
        _store_config(stored_path, config, digest, data_hash)
        return ResumeInfo("new" if not old_records else "accepted", digest)
    try:
        stored_file = json.loads(stored_path.read_text())
        stored, stored_data = stored_file["config"], stored_file.get("data_hash")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise FlashSpecError(f"{stored_path} is unreadable ({type(e).__name__}); resume with "
                             "mode 'fresh' to start this run directory over") from e
    changed = config_diff(stored, config, ignore)
    data_changed = None not in (stored_data, data_hash) and stored_data != data_hash
    if not changed and not data_changed:
        if stored_data is None and data_hash is not None:   # stored before data was compared
            _store_config(stored_path, config, digest, data_hash)
        return ResumeInfo("same", digest)
    what = []
    if changed:
        shown = ", ".join(changed[:8]) + (f" (+{len(changed) - 8} more)" if len(changed) > 8 else "")
        what.append(f"another config (differs in: {shown})")
    if data_changed:
        what.append(f"other prompt data (data hash {stored_data[:12]} then, {data_hash[:12]} "
                    "now: a prompt file changed)")
    if mode == "check":
        raise FlashSpecError(
            f"{run_dir} was started with {' and '.join(what)}; use a new output dir, or resume "
            "with mode 'accept' (keep its records, continue under the new config and data) or "
            "'fresh' (move the old records aside)")
    changed = changed + (["data_hash"] if data_changed else [])
    with (run_dir / RUN_CONFIG_HISTORY).open("a") as f:
        f.write(canonical_json({"replaced_at": _utc_now(), "config": stored,
                                "data_hash": stored_data, "changed": changed}) + "\n")
    _store_config(stored_path, config, digest, data_hash)
    log.warning("%s: continuing with %s (resume=accept)", run_dir, " and ".join(what))
    return ResumeInfo("accepted", digest, changed=changed)


def _store_config(path: Path, config: dict[str, Any], digest: str,
                  data_hash: str | None = None) -> None:
    write_text_atomic(path, json.dumps({"config_hash": digest, "config": config,
                                        "data_hash": data_hash}, indent=1,
                                       sort_keys=True, default=_jsonable) + "\n")


def _archive(run_dir: Path) -> Path | None:
    keep = {LOCK_NAME, ".hydra"}
    moving = [p for p in run_dir.iterdir() if p.name not in keep and p.suffix != ".log"
              and not p.name.startswith(ARCHIVE_PREFIX)]
    if not moving:
        return None
    target = run_dir / f"{ARCHIVE_PREFIX}{_utc_now().replace(':', '')}"
    n = 1
    while target.exists():
        n += 1
        target = target.with_name(target.name.split("~")[0] + f"~{n}")
    target.mkdir()
    for p in moving:
        p.rename(target / p.name)
    log.warning("%s: starting fresh; %d earlier entries moved to %s", run_dir, len(moving), target)
    return target


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class RunLock:
    """Exclusive hold on a run directory while a run writes into it (context manager).

    ``<run_dir>/.flashspec.lock`` is created with O_EXCL and holds ``host pid``. A second run
    refuses with a FlashSpecError naming the holder; a lock left by a dead process of this host
    is taken over with a warning. A lock from another host is never taken over (its pid cannot
    be checked from here)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.held = False

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mine = f"{socket.gethostname()} {os.getpid()}\n"
        for attempt in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                host, pid = self._holder()
                if attempt == 0 and host == socket.gethostname() and pid is not None \
                        and not _alive(pid):
                    log.warning("%s: taking over the lock of process %d, which is gone",
                                self.path, pid)
                    self.path.unlink(missing_ok=True)
                    continue
                where = "" if host == socket.gethostname() else f" on host {host}"
                raise FlashSpecError(
                    f"run directory {self.path.parent} is in use by process {pid}{where}; wait "
                    f"for it, or use another output dir (if no such run is going on, delete "
                    f"{self.path})") from None
            with os.fdopen(fd, "w") as f:
                f.write(mine)
            self.held = True
            return self
        raise AssertionError("unreachable")

    def release(self) -> None:
        if self.held:
            if self._holder() == (socket.gethostname(), os.getpid()):
                self.path.unlink(missing_ok=True)
            self.held = False

    def _holder(self) -> tuple[str | None, int | None]:
        try:
            host, pid = self.path.read_text().split()
            return host, int(pid)
        except (OSError, ValueError):
            return None, None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class NullLogger:
    """The logger that does nothing (``logger=disabled``): runners log unconditionally."""

    def __init__(self, **_: Any) -> None:
        pass

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        pass

    def summary(self, data: dict[str, Any]) -> None:
        pass

    def table(self, key: str, rows: list[dict[str, Any]]) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger(NullLogger):
    """A W&B run (``mode``: offline by default, or online).

    ``group`` gathers the jobs of one sweep, ``job_type`` names the experiment; ``id`` with
    ``resume="allow"`` continues the same W&B run when a run directory is resumed."""

    def __init__(self, mode: str = "offline", project: str = "flashspec", name: str | None = None,
                 group: str | None = None, config: dict | None = None, tags: list | None = None,
                 entity: str | None = None, dir: str | Path | None = None,
                 job_type: str | None = None, id: str | None = None) -> None:
        import wandb
        self.run = wandb.init(mode=mode, project=project, name=name, group=group, entity=entity,
                              config=config, tags=list(tags or []), dir=str(dir) if dir else None,
                              job_type=job_type, id=id, resume="allow" if id else None,
                              reinit="finish_previous", settings=wandb.Settings(silent=True))

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        self.run.log(data, step=step)

    def summary(self, data: dict[str, Any]) -> None:
        self.run.summary.update(data)

    def table(self, key: str, rows: list[dict[str, Any]]) -> None:
        if rows:
            import wandb
            cols = list(rows[0])
            self.run.log({key: wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in rows])})

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
