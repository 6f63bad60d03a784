"""OmegaConf resolvers the configs use; run.py registers them before Hydra composes anything
(``hydra.sweep.subdir`` is resolved before the task runs).

``${path_safe:text}``: ``text`` as one folder name. Hydra's ``override_dirname`` keeps the
overrides' values verbatim, so ``head.rank=d/8`` would make nested job folders, and a long
override list a name over the file system's 255 bytes. '/' becomes ``%2F`` ('%' becomes ``%25``
first, so ``urllib.parse.unquote`` gives the text back) and a name over :data:`MAX_NAME_BYTES`
is cut, ending in ``~`` and a hash of the whole text (the job's ``.hydra/overrides.yaml`` keeps
the overrides in full; scripts/collect.py reads them from there).

``${by_temperature:T,greedy,sampled}``: one of two values by the decoding temperature.
"""
from __future__ import annotations

import hashlib

from omegaconf import OmegaConf

MAX_NAME_BYTES = 200   # file systems allow 255 per name; the job number and '_' come first


def path_safe(text: object, max_bytes: int = MAX_NAME_BYTES) -> str:
    """``text`` as one path component: '%' and '/' percent-escaped, at most ``max_bytes`` bytes
    (a longer one keeps its start and ends in ``~<8 hex digits of its hash>``)."""
    safe = str(text).replace("%", "%25").replace("/", "%2F")
    if len(safe.encode()) <= max_bytes:
        return safe
    digest = hashlib.sha1(str(text).encode()).hexdigest()[:8]
    start = safe.encode()[:max_bytes - len(digest) - 1].decode(errors="ignore")
    return f"{start}~{digest}"


def by_temperature(temperature: object, greedy: object, sampled: object) -> object:
    """``greedy`` when ``temperature`` is 0, else ``sampled``: a setting that differs between
    greedy and sampled decoding, e.g. the bench's tree shape,
    ``${by_temperature:${experiment.temperature},dyn15d6k4,3x1x1}``."""
    return greedy if float(temperature) == 0.0 else sampled


RESOLVERS = {"path_safe": path_safe, "by_temperature": by_temperature}


def register_resolvers() -> None:
    """Register every resolver of this module with OmegaConf (again is a no-op)."""
    for name, fn in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
