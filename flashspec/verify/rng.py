"""Counter-based random numbers shared bit-for-bit by every verify backend.

A uniform is a pure function of (seed, stream, index): ``stream`` names a (row, position)
slot of one verify call and ``index`` the element inside it (vocabulary id, or ``V`` for the
accept test). The hash is 32-bit integer arithmetic only, so the Triton kernel computes the
very same floats; values lie in (0, 1) and are never exactly 0 or 1.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MUL_A = 0x7FEB352D
MUL_B = 0x846CA68B
GOLDEN = 0x9E3779B9


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on uint32 values held in int64 tensors."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * MUL_A) & MASK32
    x = x ^ (x >> 15)
    x = (x * MUL_B) & MASK32
    return x ^ (x >> 16)


def stream_key(seed: torch.Tensor | int, stream: torch.Tensor) -> torch.Tensor:
    """Per-slot key: mix32(mix32(seed) ^ (stream * GOLDEN))."""
    seed_t = torch.as_tensor(seed, dtype=torch.int64, device=stream.device)
    return mix32(mix32(seed_t) ^ ((stream.to(torch.int64) * GOLDEN) & MASK32))


def to_unit(h: torch.Tensor) -> torch.Tensor:
    """Top 23 bits of a hash -> float32 strictly in (0, 1): (h >> 9 + 0.5) / 2^23.

    With 24 bits the largest value, (2^24 - 0.5) / 2^24, rounds to exactly 1.0 in float32
    (then E = -log u = 0 and a p = 0 token could win the race); 23 bits keep every value exact.
    """
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def uniform(seed: torch.Tensor | int, stream: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Uniform(0,1) for broadcastable int tensors ``stream`` and ``index``."""
    key = stream_key(seed, stream)
    return to_unit(mix32(key ^ ((index.to(torch.int64) * MUL_B + 1) & MASK32)))


def call_seed(seed: int, call: int) -> int:
    """Seed of the ``call``-th verify call of a run (host-side; engine keeps the counter)."""
    x = torch.tensor((seed * GOLDEN + call * MUL_A) & MASK32, dtype=torch.int64)
    return int(mix32(x))
