"""Context-conditioned selection: one independent inner policy per context value (domain), or
per combination of values (domain and n-gram match length)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from flashspec.bandits.base import Context, Policy
from flashspec.bandits.thompson import ThompsonSampling
from flashspec.core import Arm
from flashspec.errors import FlashSpecError
from flashspec.seeds import derive_seed


class PerDomain(Policy):
    """Keeps one ``inner`` policy per ``context[key]`` (default: the prompt's domain); with
    several keys, one per combination of their values (e.g. ``key=["domain", "ngram_match"]``:
    whether copying pays can differ between a chat answer and an edit at the same match length).

    ``inner`` builds a policy: ``inner(n_arms, seeds, reward_scale=...)`` — a policy class or a
    ``functools.partial`` of one (what a ``_partial_: true`` Hydra config instantiates to).
    Steps without that key share one policy (key None). ``update`` goes to the context it is
    given, or to the one of the last ``select`` when it is given none. ``counts`` / ``values``
    aggregate over domains; ``per_domain`` has the breakdown.

    Priors (when ``inner`` takes them): :meth:`warm_start` seeds every context's policy alike,
    :meth:`warm_start_domain` only those whose domain is the one given (a stream that mixes
    domains keeps one store file per domain). A context's policy is seeded when it is made.
    """

    name = "contextual"

    def __init__(self, n_arms: int, seed: int | Sequence[int] = 0,
                 inner: Callable[..., Policy] = ThompsonSampling,
                 key: str | Sequence[str] = "domain", **kw: Any) -> None:
        super().__init__(n_arms, seed, **kw)
        self.inner = inner
        self.keys = (key,) if isinstance(key, str) else tuple(str(k) for k in key)
        if not self.keys or len(set(self.keys)) != len(self.keys):
            raise FlashSpecError(f"bandit=contextual: key must name one context entry or several "
                                 f"distinct ones (e.g. [domain, ngram_match]), got {key!r}")
        self.policies: dict[object, Policy] = {}
        self._last_key: object = None
        # priors for every context (key None) or for one domain: (pulls, means, costs, weight)
        self._priors: dict[object, tuple] = {}
        first = self._policy(None)  # validate the inner policy now rather than at the first step
        if isinstance(first, PerDomain):
            raise FlashSpecError("bandit=contextual: inner must be a non-contextual policy, "
                                 "e.g. inner: {_target_: flashspec.bandits.ThompsonSampling}")
        self.inner_name = first.name
        self.takes_priors = first.takes_priors

    def warm_start(self, pulls: Sequence[float], means: Sequence[float],
                   costs: Sequence[float] | None = None, weight: float = 20.0) -> None:
        """Every context's policy starts from these stats (see :meth:`Policy.warm_start`)."""
        super().warm_start(pulls, means, costs, weight)
        self._set_priors(None, (pulls, means, costs, weight))

    def warm_start_domain(self, domain: str, pulls: Sequence[float], means: Sequence[float],
                          costs: Sequence[float] | None = None, weight: float = 20.0) -> None:
        """The policies of the contexts of ``domain`` start from these stats."""
        if "domain" not in self.keys:
            raise FlashSpecError(f"bandit={self.label}: priors per domain need a policy keyed "
                                 f"on the domain (key: {list(self.keys)})")
        if not self.takes_priors:
            raise FlashSpecError(f"bandit={self.label}: its inner policy does not start from "
                                 "priors; run it cold (priors.use=false)")
        self._set_priors(str(domain), (pulls, means, costs, weight))

    def _set_priors(self, domain: str | None, priors: tuple) -> None:
        if any(p.t for p in self.policies.values()):
            raise FlashSpecError(f"bandit={self.label}: priors after the first update; they "
                                 "only seed a fresh policy")
        self._priors[domain] = priors
        for key in list(self.policies):   # made before the priors came: make them again
            if self._domain_of(key) == domain or domain is None:
                del self.policies[key]

    def _domain_of(self, key: object) -> object:
        if "domain" not in self.keys:
            return None
        return key if len(self.keys) == 1 else (key[self.keys.index("domain")]
                                                if isinstance(key, tuple) else None)

    @property
    def context_keys(self) -> tuple[str, ...]:
        return self.keys

    @property
    def outcome_keys(self) -> tuple[str, ...]:
        return self._policy(None).outcome_keys

    def bind_arms(self, arms: Sequence[Arm]) -> None:
        """Every inner policy, present and future, is told what the arms are."""
        super().bind_arms(arms)
        for p in self.policies.values():
            p.bind_arms(arms)

    @property
    def label(self) -> str:
        inner = "" if self.inner_name == "thompson" else f"({self.inner_name})"
        key = "" if self.keys == ("domain",) else f"[{'+'.join(self.keys)}]"
        return self.name + key + inner + self._label_suffix()

    def _policy(self, key: object) -> Policy:
        if key not in self.policies:
            seeds = [derive_seed(s, key) for s in self.seeds]
            policy = self.inner(self.n_arms, seeds, reward_scale=self.reward_scale)
            if self.arm_specs is not None:
                policy.bind_arms(self.arm_specs)
            priors = self._priors.get(self._domain_of(key), self._priors.get(None))
            if priors is not None:
                pulls, means, costs, weight = priors
                policy.warm_start(pulls, means, costs, weight=weight)
            self.policies[key] = policy
        return self.policies[key]

    def _key(self, context: Context) -> object:
        if context is None:
            return None
        if len(self.keys) == 1:
            return context.get(self.keys[0])
        return tuple(context.get(k) for k in self.keys)

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
