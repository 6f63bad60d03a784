"""OmegaConf resolvers the configs use; run.py registers them before Hydra composes anything
(``hydra.sweep.subdir`` is resolved before the task runs).

``${path_safe:text}``: ``text`` as one folder name. Hydra's ``override_dirname`` keeps the
overrides' values verbatim, so ``head.rank=d/8`` would make nested job folders; '/' becomes
``%2F`` (and '%' becomes ``%25`` first, so ``urllib.parse.unquote`` gives the text back).
"""
from __future__ import annotations

from omegaconf import OmegaConf


def path_safe(text: object) -> str:
    """``text`` with '%' and '/' percent-escaped: one path component, reversible by unquote."""
    return str(text).replace("%", "%25").replace("/", "%2F")


RESOLVERS = {"path_safe": path_safe}


def register_resolvers() -> None:
    """Register every resolver of this module with OmegaConf (again is a no-op)."""
    for name, fn in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
