"""OmegaConf resolvers and config helpers (the library itself never needs Hydra)."""
from __future__ import annotations

from omegaconf import OmegaConf

from flashspec.errors import FlashSpecError


def parse_rank(rank: int | str, hidden: int) -> int:
    """Resolve a head rank written as an int or as a fraction of d: 'd/8', 'd/16', '3d/4'."""
    if isinstance(rank, str):
        text = rank.replace(" ", "")
        if "d" not in text:
            value = int(text)
        else:
            num, _, den = text.partition("/")
            mult = int(num[:-1] or 1) if num.endswith("d") else None
            if mult is None:
                raise FlashSpecError(f"head.rank {rank!r} is not an int or 'd/N'; try head.rank=d/8")
            value = hidden * mult // int(den or 1)
    else:
        value = int(rank)
    if not 0 < value <= hidden:
        raise FlashSpecError(f"head.rank {rank!r} resolves to {value}, outside (0, d={hidden}]; "
                             "pick a rank between 1 and the drafter's hidden size")
    return value


def register_resolvers() -> None:
    """Register `${rank:d/8,576}` and `${eval:...}`-free helpers once."""
    if not OmegaConf.has_resolver("rank"):
        OmegaConf.register_new_resolver("rank", lambda r, d: parse_rank(r, int(d)))
