"""Turn config mappings (Hydra or plain dicts) into library objects: target, drafters, arms, policy."""
from __future__ import annotations

import logging
from typing import Any, Mapping

from flashspec.drafters import Drafter, ModelDrafter, NgramDrafter
from flashspec.engine import Arm, FixedPolicy
from flashspec.errors import FlashSpecError
from flashspec.models import LlamaLM, load_model
from flashspec.models.loading import source_config

log = logging.getLogger(__name__)

DRAFTER_KINDS = ("ngram", "layerskip", "model")


def build_target(cfg_target: Mapping[str, Any], cfg_hardware: Mapping[str, Any]):
    """(model, tokenizer) of the target on the hardware profile's device and dtype
    (``fused_layers: true``: few-token steps through the fused decode kernels)."""
    model, tokenizer = load_model(
        cfg_target["source"], dtype=cfg_target.get("dtype") or cfg_hardware["dtype"],
        device=cfg_hardware["device"],
        quantization=cfg_target.get("quantization") or cfg_hardware.get("quantization"))
    if cfg_hardware.get("fused_layers"):
        from flashspec.models.fused import fuse_model   # Triton: only when asked for
        fuse_model(model)
    return model, tokenizer


def layer_set(spec: Mapping[str, Any], n_layers: int) -> list[int]:
    """Layers of a self-drafter: ``layers: [..]`` explicit, ``first: k``, or ``skip: [lo, hi)``."""
    if spec.get("layers") is not None:
        layers = [int(i) for i in spec["layers"]]
    elif spec.get("first") is not None:
        layers = list(range(int(spec["first"])))
    elif spec.get("skip") is not None:
        lo, hi = (int(x) for x in spec["skip"])
        layers = [i for i in range(n_layers) if not lo <= i < hi]
    else:
        raise FlashSpecError(f"layerskip drafter {spec.get('name')!r} needs `layers`, `first` or `skip`")
    if not layers or any(not 0 <= i < n_layers for i in layers):
        raise FlashSpecError(f"layerskip drafter {spec.get('name')!r}: layers must be a non-empty "
                             f"subset of 0..{n_layers - 1}, got {layers}")
    return layers


def check_shared_vocab(name: str, target_tok, drafter_tok, target: LlamaLM, drafter: LlamaLM) -> None:
    """Speculative decoding needs the same token ids on both sides."""
    if (target.shape.vocab_size != drafter.shape.vocab_size
            or target_tok.get_vocab() != drafter_tok.get_vocab()):
        raise FlashSpecError(f"drafter {name!r} has a different vocabulary/tokenizer than the target "
                             f"({drafter.shape.vocab_size} vs {target.shape.vocab_size} ids); pick a "
                             "drafter of the same model family")


def make_head(cfg_head: Mapping[str, Any] | None, model: LlamaLM):
    """The drafter head from conf/head (None for the model's own full head)."""
    if not cfg_head or (cfg_head.get("kind") or "full") == "full":
        return None
    from flashspec.heads import build_head
    return build_head(cfg_head, model.lm_head_weight, model.shape.hidden_size)


def build_drafter(spec: Mapping[str, Any], target: LlamaLM, tokenizer, cfg_hardware: Mapping[str, Any],
                  cfg_head: Mapping[str, Any] | None = None) -> Drafter:
    """One drafter from its config entry (kind: ngram | layerskip | model)."""
    kind, name = spec.get("kind"), spec.get("name") or spec.get("kind")
    if kind == "ngram":
        return NgramDrafter(int(spec.get("max_ngram", 3)), int(spec.get("min_ngram", 1)), name=name)
    if kind == "layerskip":
        layers = layer_set(spec, target.shape.num_layers)
        return ModelDrafter(target, layers, head=make_head(cfg_head, target), name=name)
    if kind == "model":
        config = source_config(spec["source"])
        if config is not None and config.vocab_size != target.shape.vocab_size:
            raise FlashSpecError(f"drafter {name!r} has a different vocabulary than the target "
                                 f"({config.vocab_size} vs {target.shape.vocab_size} ids); pick a "
                                 "drafter of the same model family")
        model, tok = load_model(spec["source"], dtype=spec.get("dtype") or cfg_hardware["dtype"],
                                device=cfg_hardware["device"], quantization=spec.get("quantization"))
        check_shared_vocab(name, tokenizer, tok, target, model)
        return ModelDrafter(model, None, head=make_head(cfg_head, model), name=name)
    if kind == "eagle":  # feature-level drafter from experiment=train_drafter
        from flashspec.drafters.eagle import EagleDrafter
        return EagleDrafter.from_spec(spec, target, cfg_head)
    raise FlashSpecError(f"unknown drafter kind {kind!r} for {name!r}; choose one of {DRAFTER_KINDS}")


def arm_pairs(cfg_drafters: Mapping[str, Any]) -> list[tuple[str, int]]:
    """(drafter name, γ) per arm: the explicit ``arms`` list, or every drafter × every γ."""
    pairs = cfg_drafters.get("arms")
    if pairs is None:
        names = [d.get("name") or d.get("kind") for d in cfg_drafters.get("drafters", [])]
        pairs = [(name, g) for name in names for g in cfg_drafters.get("gammas", [4])]
    return [(name, gamma) for name, gamma in pairs]


def build_arms(cfg_drafters: Mapping[str, Any], drafters: Mapping[str, Drafter]) -> list[Arm]:
    """Arms (drafter, γ): the explicit ``arms`` list, or every drafter × every γ in ``gammas``.

    The name ``ar`` (any γ) is the arm without speculation (target-only step)."""
    arms = []
    for name, gamma in arm_pairs(cfg_drafters):
        if name == "ar":  # no speculation: the policy may fall back to target-only steps
            arms.append(Arm(None, 0))
            continue
        if name not in drafters:
            raise FlashSpecError(f"arm names drafter {name!r}, not in the drafter set {list(drafters)}")
        if int(gamma) <= 0:
            raise FlashSpecError(f"gamma must be a positive int, got {gamma} for drafter {name!r}")
        arms.append(Arm(drafters[name], int(gamma)))
    return arms


def build_policy(cfg_bandit: Mapping[str, Any] | None, n_arms: int, seed: int):
    """The drafter-selection policy (fixed arm when no bandit is configured)."""
    if not cfg_bandit or cfg_bandit.get("name", "fixed") == "fixed":
        arm = int((cfg_bandit or {}).get("arm", 0))
        if not 0 <= arm < n_arms:
            raise FlashSpecError(f"bandit.arm={arm} but there are {n_arms} arms")
        return FixedPolicy(arm)
    from flashspec.bandits import from_config
    return from_config(cfg_bandit, n_arms, seed)
