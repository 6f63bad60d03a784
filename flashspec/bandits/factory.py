"""Build policies by name (``make_policy``) or from a ``conf/bandit/<name>.yaml`` mapping."""
from __future__ import annotations

import inspect
from typing import Any, Mapping, Sequence

from flashspec.bandits.base import Policy
from flashspec.bandits.contextual import PerDomain
from flashspec.bandits.exp3 import EXP3
from flashspec.bandits.index import UCB1, EpsilonGreedy, FixedArm, Oracle, SlidingWindowUCB
from flashspec.bandits.rate import RateThompson
from flashspec.bandits.rewards import REWARD_KINDS
from flashspec.bandits.thompson import DiscountedThompson, ThompsonSampling
from flashspec.errors import FlashSpecError

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (
    FixedArm, EpsilonGreedy, UCB1, ThompsonSampling, SlidingWindowUCB, DiscountedThompson,
    EXP3, Oracle, PerDomain, RateThompson)}

# Keys of a bandit config read by the engine, not by the policy constructor.
ENGINE_KEYS = ("name", "reward", "full_info")


def _accepted(cls: type[Policy]) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            names |= set(inspect.signature(klass.__init__).parameters)
    return names - {"self", "n_arms", "seed", "kw"}


def make_policy(name: str, n_arms: int, seed: int | Sequence[int] = 0, **kwargs: Any) -> Policy:
    """Policy ``name`` over ``n_arms`` arms; ``seed`` may be a list (one replicate per seed)."""
    cls = POLICIES.get(name)
    if cls is None:
        raise FlashSpecError(f"unknown bandit policy {name!r}; choose one of {', '.join(POLICIES)}")
    unknown = set(kwargs) - _accepted(cls)
    if unknown:
        raise FlashSpecError(f"bandit={name} does not take {', '.join(sorted(unknown))}; "
                             f"it takes {', '.join(sorted(_accepted(cls)))}")
    return cls(n_arms, seed, **kwargs)


def from_config(cfg_bandit: Mapping[str, Any], n_arms: int, seed: int | Sequence[int] = 0,
                **overrides: Any) -> Policy:
    """Policy from a bandit config (``name``, hyper-parameters, ``reward``, ``full_info``).

    The returned policy carries ``reward_kind`` and ``full_info`` for the engine.
    ``overrides`` (e.g. an oracle's ``means``) win over config keys.
    """
    cfg = plain(cfg_bandit)
    if "name" not in cfg:
        raise FlashSpecError("bandit config has no 'name'; pick one with bandit=<name>")
    kind = cfg.get("reward", "alpha")
    if kind not in REWARD_KINDS:
        raise FlashSpecError(f"bandit.reward={kind!r} is unknown; choose one of {', '.join(REWARD_KINDS)}")
    kwargs = {k: v for k, v in cfg.items() if k not in ENGINE_KEYS}
    kwargs.update(overrides)
    policy = make_policy(cfg["name"], n_arms, seed, **kwargs)
    policy.reward_kind = kind
    policy.full_info = bool(cfg.get("full_info", False))
    return policy


def plain(x: Any) -> Any:
    """Nested mappings / sequences (e.g. an OmegaConf node) as plain dicts and lists."""
    if isinstance(x, Mapping) or hasattr(x, "items"):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)) or type(x).__name__ == "ListConfig":
        return [plain(v) for v in x]
    return x
