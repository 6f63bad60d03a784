"""Drafters: a separate model, a layer subset of the target (self-draft), n-gram lookup."""
from flashspec.drafters.base import DecodeState, Drafter
from flashspec.drafters.model import ModelDrafter
from flashspec.drafters.ngram import NgramDrafter

__all__ = ["DecodeState", "Drafter", "ModelDrafter", "NgramDrafter"]
