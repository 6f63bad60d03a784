"""Host-side helpers shared by the Triton verify launchers (chain: triton_backend, tree:
triton_tree): once-per-reason fallback logging, argument preparation (what the kernels take,
and so when they fall back, is :mod:`flashspec.kernels`' rule)."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("flashspec.verify.triton")

LOGGED: set[str] = set()
_DUMMY_SEED: dict[torch.device, torch.Tensor] = {}


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def log_once(reason: str) -> None:
    if reason not in LOGGED:
        LOGGED.add(reason)
        log.warning("triton verify falls back to the torch reference: %s", reason)


def seed_args(seed: int | torch.Tensor, device: torch.device) -> tuple[torch.Tensor, int, int]:
    """(int64 seed tensor, int32 seed, seed_mode) without reading a device tensor on the host;
    seed_mode 1 reads the tensor, 0 the int (the tensor is then a cached dummy)."""
    if isinstance(seed, torch.Tensor):
        if seed.numel() != 1:
            raise ValueError("seed tensor must hold one element")
        if seed.device != device:
            seed = seed.to(device)
        return seed.to(torch.int64), 0, 1
    s = int(seed) & 0xFFFFFFFF
    dummy = _DUMMY_SEED.get(device)
    if dummy is None:
        dummy = _DUMMY_SEED[device] = torch.zeros((), dtype=torch.int64, device=device)
    return dummy, s - (1 << 32) if s >= 1 << 31 else s, 0


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, L, V] with unit inner strides (batch stride free); copies only when needed."""
    if x.stride(2) == 1 and (x.stride(1) == x.shape[2] or x.shape[1] == 1):
        return x
    return x.contiguous()
