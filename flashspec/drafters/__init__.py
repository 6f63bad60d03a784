"""Drafters: a separate model, a layer subset of the target (self-draft), n-gram lookup, and the
trained feature-level (EAGLE-style) drafter."""
from flashspec.drafters.base import DraftContext, Drafter, HostFacts
from flashspec.drafters.eagle import EagleDrafter
from flashspec.drafters.model import ModelDrafter
from flashspec.drafters.ngram import NgramDrafter

__all__ = ["DraftContext", "Drafter", "EagleDrafter", "HostFacts", "ModelDrafter", "NgramDrafter"]
