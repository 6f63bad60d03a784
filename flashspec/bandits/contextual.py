"""Context-conditioned selection: one independent inner policy per context value (domain)."""
from __future__ import annotations

import zlib
from typing import Any, Mapping, Sequence

import numpy as np

from flashspec.bandits.base import Context, Policy
from flashspec.errors import FlashSpecError


def derive_seed(seed: int, key: object) -> int:
    """Stable per-context seed (independent of Python's randomised ``hash``)."""
    tag = zlib.crc32(repr(key).encode())
    return int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, tag]).generate_state(1)[0])


class PerDomain(Policy):
    """Keeps one ``inner`` policy per ``context[key]`` (default: the prompt's domain).

    Steps without that key share one policy (key None). ``update`` goes to the context it is
    given, or to the one of the last ``select`` when it is given none. ``counts`` / ``values``
    aggregate over domains; ``per_domain`` has the breakdown.
    """

    name = "contextual"

    def __init__(self, n_arms: int, seed: int | Sequence[int] = 0,
                 inner: str | Mapping[str, Any] = "thompson", key: str = "domain", **kw: float) -> None:
        super().__init__(n_arms, seed, **kw)
        spec = {"name": inner} if isinstance(inner, str) else dict(inner)
        if spec.get("name") in (None, self.name):
            raise FlashSpecError("bandit=contextual: inner must name a non-contextual policy, "
                                 "e.g. inner: {name: thompson}")
        spec.setdefault("reward_scale", self.reward_scale)
        self.inner_spec = spec
        self.key = key
        self.policies: dict[object, Policy] = {}
        self._last_key: object = None
        self._policy(None)  # validate the inner spec now rather than at the first step

    @property
    def context_keys(self) -> tuple[str, ...]:
        """Context entries this policy reads (the engine computes drafter features on demand)."""
        return (self.key,)

    def _policy(self, key: object) -> Policy:
        if key not in self.policies:
            from flashspec.bandits.factory import make_policy
            spec = dict(self.inner_spec)
            name = spec.pop("name")
            seeds = [derive_seed(s, key) for s in self.seeds]
            self.policies[key] = make_policy(name, self.n_arms, seeds, **spec)
        return self.policies[key]

    def _key(self, context: Context) -> object:
        return None if context is None else context.get(self.key)

    def select_many(self, context: Context = None) -> np.ndarray:
        self._last_key = self._key(context)
        return self._policy(self._last_key).select_many(context)

    def _observe(self, r: np.ndarray, c: np.ndarray, pulled: np.ndarray | None, context: Context) -> None:
        key = self._last_key if context is None else self._key(context)
        self._policy(key)._observe(r, c, pulled, context)
        super()._observe(r, c, pulled, context)

    @property
    def per_domain(self) -> dict[object, dict[str, list]]:
        """Counts and values of each context's inner policy."""
        return {k: {"counts": p.counts.tolist(), "values": p.values.tolist()}
                for k, p in self.policies.items() if p.t > 0}
