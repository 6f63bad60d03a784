"""Adding a drafter or a bandit policy takes its module, its config and its test: here all three
are this file. A "repeat the last token" drafter (one method of the drafter protocol) and a
round-robin policy are defined below, selected through the same config entries a user writes,
and decode exactly (greedy equals AR) under both steppers: the reference one and the captured
one (uncaptured on a CPU: the same device ops)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from experiments.harness import build_arms, build_drafters, make_policy
from flashspec.bandits import Policy
from flashspec.core import Arm, SamplingParams
from flashspec.drafters import DraftContext, Drafter
from flashspec.engine import SpecEngine
from flashspec.models import load_model
from omegaconf import OmegaConf


class RepeatLastDrafter(Drafter):
    """Proposes the row's last committed token γ times (deterministic: q is one-hot)."""

    one_hot = True

    def __init__(self, name: str = "repeat") -> None:
        self.name = name

    def draft(self, tokens: torch.Tensor, lengths: torch.Tensor, gamma: int,
              params: SamplingParams, seed: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        last = tokens.gather(1, (lengths - 1)[:, None])
        return last.expand(-1, gamma).contiguous(), None, None


class RoundRobin(Policy):
    """Plays the arms in turn, one per step (no learning)."""

    name = "round_robin"
    learns = False
    turn = 0

    def select_many(self, context=None) -> np.ndarray:
        self.turn += 1
        return np.full(self.n_envs, (self.turn - 1) % self.n_arms, dtype=np.int64)


DRAFTERS = OmegaConf.create({
    "drafters": {
        "repeat": {"_target_": "test_extension.RepeatLastDrafter.build", "_partial_": True},
        "ngram": {"_target_": "flashspec.drafters.NgramDrafter.build", "_partial_": True},
    },
    "gammas": [2, 3],
    "arms": None,
})
BANDIT = OmegaConf.create({"_target_": "test_extension.RoundRobin", "_partial_": True})


@pytest.fixture(scope="module")
def tiny():
    return load_model("dummy:smollm2-135m", dtype="float32", seed=0)


@pytest.mark.parametrize("stepper", [{}, {"resident": True, "chunk": 1}, {"graphs": True}])
def test_new_drafter_and_policy_from_config_decode_exactly(tiny, stepper):
    model, tok = tiny
    drafters = build_drafters(DRAFTERS, DraftContext(model, tok))
    assert isinstance(drafters["repeat"], RepeatLastDrafter) and drafters["repeat"].name == "repeat"
    arms = build_arms(DRAFTERS, drafters)
    assert [a.label for a in arms] == ["repeat@2", "repeat@3", "ngram@2", "ngram@3"]
    policy = make_policy(BANDIT, len(arms), seed=0)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [9, 9, 9, 9, 10]]
    ar = SpecEngine(model, [Arm()]).generate(prompts, 16)
    engine = SpecEngine(model, arms, policy, drafters=list(drafters.values()), **stepper)
    engine.min_capacity = 64     # the captured stepper attends its whole cache: keep it short
    spec = engine.generate(prompts, 16)
    assert [r.tokens for r in spec.rows] == [r.tokens for r in ar.rows]
    played = spec.rows[0].arms
    assert played[:4] == [0, 1, 2, 3]          # the round-robin policy really chose the arms
    assert sum(r.n_proposed for r in spec.rows) > 0
