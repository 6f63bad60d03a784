"""Per-step rewards fed to a policy, computed from what one speculative step produced."""
from __future__ import annotations

from flashspec.errors import FlashSpecError

REWARD_KINDS = ("alpha", "tps", "accepted_per_cost")


def reward(kind: str = "alpha", n_proposed: int = 0, n_accepted: int = 0, wall_s: float | None = None,
           draft_cost: float | None = None, n_rows: int = 1) -> float:
    """Reward of one speculative step.

    - ``alpha``: accepted / proposed draft tokens (in [0, 1]).
    - ``tps``: tokens emitted per second of the step, (accepted + n_rows) / wall_s; each row
      emits its accepted tokens plus one bonus/correction token.
    - ``accepted_per_cost``: accepted tokens per unit of drafting cost (``draft_cost``, e.g.
      γ × drafter cost per token in target-forward units).

    Counts are summed over the ``n_rows`` rows of the batch.
    """
    if not 0 <= n_accepted <= n_proposed:
        raise FlashSpecError(f"reward: need 0 <= n_accepted ({n_accepted}) <= n_proposed ({n_proposed})")
    if kind == "alpha":
        if n_proposed <= 0:
            raise FlashSpecError("reward=alpha needs n_proposed > 0")
        return n_accepted / n_proposed
    if kind == "tps":
        if wall_s is None or not wall_s > 0:
            raise FlashSpecError(f"reward=tps needs the step's wall time wall_s > 0, got {wall_s}")
        return (n_accepted + n_rows) / wall_s
    if kind == "accepted_per_cost":
        if draft_cost is None or not draft_cost > 0:
            raise FlashSpecError(f"reward=accepted_per_cost needs draft_cost > 0, got {draft_cost}")
        return n_accepted / draft_cost
    raise FlashSpecError(f"unknown bandit reward {kind!r}; choose one of {', '.join(REWARD_KINDS)}")
