"""EAGLE checkpoint I/O lives in the drafters package (:mod:`flashspec.drafters.eagle_checkpoint`);
these names stay importable from here for the training code."""
from flashspec.drafters.eagle_checkpoint import (FORMAT, SHAPE_KEYS, load_eagle,  # noqa: F401
                                                 read_eagle_metadata, save_eagle, target_signature)
