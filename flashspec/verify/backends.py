"""Registry of verify backends: name -> factory ``make(options) -> Backend``.

Built in: ``torch`` (:mod:`flashspec.verify.torch_backend`: the readable, exact references) and ``triton``
(:mod:`flashspec.verify.triton_backend`, fused kernels; imported only when asked for, so the
torch path never imports triton). A new backend lives in its own module, which registers it
(``register_backend("mine", make_backend)`` at import) or is named by the config as
``"package.module:make_backend"``; nothing here changes. Adding one touches its module, its
config and its test.
"""
from __future__ import annotations

import importlib
from typing import Callable

from flashspec.options import DEFAULT, KernelOptions
from flashspec.verify.api import Backend

Factory = Callable[[KernelOptions], Backend]

# name -> factory, or "module:attribute" of one (imported on first use)
_REGISTRY: dict[str, Factory | str] = {
    "torch": "flashspec.verify.torch_backend:make_backend",
    "triton": "flashspec.verify.triton_backend:make_backend",
}


def register_backend(name: str, make: Factory | str, replace: bool = False) -> None:
    """Register backend ``name``: a factory of :class:`Backend` from :class:`KernelOptions`,
    or its "module:attribute" path. Refuses to shadow a registered name unless ``replace``."""
    if name in _REGISTRY and not replace and _REGISTRY[name] is not make:
        raise ValueError(f"verify backend {name!r} is already registered")
    _REGISTRY[name] = make


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def _resolve(spec: Factory | str) -> Factory:
    if not isinstance(spec, str):
        return spec
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def get_backend(backend: str | Backend, options: KernelOptions | None = None) -> Backend:
    """The backend registered as ``backend`` (or "module:factory"), built with ``options``
    (default: :data:`flashspec.options.DEFAULT`); a :class:`Backend` is returned as is."""
    if isinstance(backend, Backend):
        return backend
    spec = _REGISTRY.get(backend)
    if spec is None and ":" in backend:
        spec = backend
    if spec is None:
        raise ValueError(f"unknown verify backend {backend!r}; choose one of "
                         f"{', '.join(backend_names())} (or register one)")
    return _resolve(spec)(DEFAULT if options is None else options)
