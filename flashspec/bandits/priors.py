"""Priors that carry over: a calibration store of what earlier runs measured of each arm.

A cold policy spends its first steps finding out what an earlier run on the same target,
drafters, machine and kind of prompt already measured. The store keeps, per :class:`PriorKey`
(target, hardware, prompt domain, reward kind, the drafter set: its arm labels and a digest of
what its drafters are), each arm's observed steps (``pulls``), mean reward and mean step cost,
one JSON file per key under a directory. A policy starts from them with
:meth:`~flashspec.bandits.Policy.warm_start`, pseudo-pulls capped at a weight so that it still
adapts; the paper's experiments start cold (``priors.use=false``).

Stats are matched to a policy's arms by label, never by position: a store written for the arms
``[a, b, c]`` warms a policy over ``[c, a, b]`` correctly, and a store whose arms are not the
policy's is refused (:meth:`Priors.aligned`), never applied to other arms.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from flashspec.bandits.rewards import REWARD_KINDS
from flashspec.errors import FlashSpecError
from flashspec.paths import write_text_atomic

log = logging.getLogger(__name__)
FORMAT = 1   # the files' layout version; a reader refuses another


@dataclass(frozen=True)
class PriorKey:
    """What the stats of one file were measured under. ``arms``: the drafter set's arm labels
    (:attr:`flashspec.core.Arm.label`), kept sorted (the set, not the policy's index order);
    ``drafters``: a digest of what the drafters are (their resolved config entries, checkpoint
    files by content): the same labels over other weights or another head are another set;
    ``sampling``: the sampling settings (acceptance at T = 0 is not acceptance at T = 1)."""

    target: str
    hardware: str
    domain: str
    reward: str
    arms: tuple[str, ...]
    drafters: str = ""
    sampling: str = "greedy"

    def __post_init__(self) -> None:
        if self.reward not in REWARD_KINDS:
            raise FlashSpecError(f"priors: reward {self.reward!r} is not one of {REWARD_KINDS}")
        if len(set(self.arms)) != len(self.arms) or not self.arms:
            raise FlashSpecError(f"priors: arm labels must be distinct and non-empty, got "
                                 f"{list(self.arms)}")
        object.__setattr__(self, "arms", tuple(sorted(self.arms)))

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()

    @property
    def filename(self) -> str:
        """``<target>-<hardware>-<domain>-<reward>-<digest 12>.json`` (readable, unique per key)."""
        parts = [_slug(x) for x in (self.target, self.hardware, self.domain, self.reward)]
        return "-".join(parts + [self.digest[:12]]) + ".json"

    def same_setting(self, other: "PriorKey") -> bool:
        """Same target, machine, domain and reward kind (the arms or drafters may differ)."""
        return (self.target, self.hardware, self.domain, self.reward) == \
            (other.target, other.hardware, other.domain, other.reward)


@dataclass(frozen=True)
class ArmStats:
    """One arm's measured steps: how many, their mean reward (in the key's reward kind, not
    scaled) and mean step cost in seconds (None: not measured)."""

    pulls: int
    mean: float
    cost: float | None = None

    def __post_init__(self) -> None:
        if self.pulls < 0 or not np.isfinite(self.mean) or \
                (self.cost is not None and not self.cost > 0):
            raise FlashSpecError(f"priors: arm stats need pulls >= 0, a finite mean and a cost "
                                 f"> 0 or None; got {self}")


@dataclass
class Priors:
    """The stats of every arm of one key (by label) and where they come from."""

    key: PriorKey
    arms: dict[str, ArmStats]
    source: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if set(self.arms) != set(self.key.arms):
            raise FlashSpecError(f"priors: stats for arms {sorted(self.arms)} under a key of arms "
                                 f"{list(self.key.arms)}")

    def aligned(self, labels: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(pulls, means, costs)`` ``[K]`` in the order of ``labels`` (a policy's arms by
        index; cost NaN where unknown). The labels must be the store's arms exactly."""
        if sorted(labels) != list(self.key.arms):
            raise FlashSpecError(f"priors of arms {list(self.key.arms)} do not fit a policy over "
                                 f"{list(labels)}; they are never applied to other arms")
        stats = [self.arms[a] for a in labels]
        return (np.array([s.pulls for s in stats], dtype=float),
                np.array([s.mean for s in stats], dtype=float),
                np.array([np.nan if s.cost is None else s.cost for s in stats], dtype=float))

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "key": {**asdict(self.key), "arms": list(self.key.arms)},
                "arms": {a: asdict(s) for a, s in sorted(self.arms.items())},
                "source": self.source}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Priors":
        if data.get("format") != FORMAT:
            raise FlashSpecError(f"priors file format {data.get('format')!r}, this code reads "
                                 f"{FORMAT}")
        k = data["key"]
        key = PriorKey(**{**k, "arms": tuple(k["arms"])})
        return cls(key, {a: ArmStats(**s) for a, s in data["arms"].items()},
                   dict(data.get("source") or {}))


def save_priors(directory: str | Path, priors: Priors) -> Path:
    """Writes (replaces) the file of ``priors.key`` under ``directory``; returns its path."""
    path = Path(directory) / priors.key.filename
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(priors.to_json(), indent=1, sort_keys=True) + "\n")
    return path


def load_priors(directory: str | Path, key: PriorKey) -> Priors | None:
    """The stats stored for ``key``, or None when ``directory`` holds none (a cold start, which
    :func:`describe_miss` explains). A file under the key's name whose content is of another
    key is refused."""
    path = Path(directory) / key.filename
    if not path.is_file():
        return None
    try:
        priors = Priors.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise FlashSpecError(f"priors file {path} is not a priors store ({e})") from None
    if priors.key != key:
        raise FlashSpecError(f"priors file {path} holds stats of {priors.key}, not of {key}")
    return priors


def describe_miss(directory: str | Path, key: PriorKey) -> str:
    """Why :func:`load_priors` found nothing: no store, or stores of the same target, machine,
    domain and reward kind for other drafter sets (named, so a user sees what differs)."""
    root = Path(directory)
    near = []
    for path in sorted(root.glob("*.json")) if root.is_dir() else []:
        try:
            other = Priors.from_json(json.loads(path.read_text())).key
        except (ValueError, KeyError, TypeError, FlashSpecError):
            continue
        if other.same_setting(key):
            what = [f"arms {','.join(other.arms)}"] if other.arms != key.arms else []
            what += ["other drafters (weights, head or settings)"] \
                if other.drafters != key.drafters else []
            what += [f"sampling {other.sampling}"] if other.sampling != key.sampling else []
            near.append(f"{path.name} ({'; '.join(what)})")
    where = f"no priors for {key.target} on {key.hardware}, domain {key.domain}, reward " \
            f"{key.reward}, arms {','.join(key.arms)} in {root}"
    return where + (f"; stored for the same setting: {'; '.join(near)}" if near else "")


def arm_stats(rewards: Iterable[float], cost: float | None = None) -> ArmStats:
    """Stats of one arm from its per-step rewards and mean step seconds (None: unknown)."""
    r = np.asarray(list(rewards), dtype=float)
    return ArmStats(int(r.size), float(r.mean()) if r.size else 0.0,
                    float(cost) if cost is not None and cost > 0 else None)


def pooled(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], reward: str
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One ``(pulls, means, costs)`` from several (each as :meth:`Priors.aligned` gives it, in
    one arm order): what the arms made over all of them together. A ``tps`` mean is a pooled
    rate (tokens over seconds), so it pools weighted by each part's seconds (pulls x cost);
    other means, and arms without a cost, pool weighted by pulls."""
    if not parts:
        raise FlashSpecError("pooled: no priors to pool")
    n, mean, cost = (np.stack(x) for x in zip(*parts))
    timed = reward == "tps" and bool(np.isfinite(cost).all())
    w = n * cost if timed else n
    total = w.sum(axis=0)
    means = np.divide((w * mean).sum(axis=0), total, out=mean.mean(axis=0), where=total > 0)
    pulls = n.sum(axis=0)
    known = np.isfinite(cost).all(axis=0) & (pulls > 0)
    costs = np.divide((n * cost).sum(axis=0), pulls, out=np.full(pulls.shape, np.nan),
                      where=known)
    return pulls, means, costs


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._]+", "_", str(text)).strip("_") or "none"
