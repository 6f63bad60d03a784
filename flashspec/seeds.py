"""Seeds derived from a run seed and a key, stable across processes and Python versions."""
from __future__ import annotations

import zlib

import numpy as np


def derive_seed(seed: int, key: object) -> int:
    """A 32-bit seed from ``seed`` and ``key`` (hashed through ``repr``, not Python's randomised
    ``hash``): a bandit context, or a record's (method, prompt, turn)."""
    tag = zlib.crc32(repr(key).encode())
    return int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, tag]).generate_state(1)[0])
