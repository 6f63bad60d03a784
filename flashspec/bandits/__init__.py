"""Online drafter selection: K-armed bandit policies over (drafter, γ) arms.

Build a policy directly (``UCB1(n_arms, seed, c=1.0, reward="alpha")``) or from a
``conf/bandit/*.yaml`` with ``hydra.utils.instantiate(cfg.bandit)(n_arms, seed)``. Each
speculative step the engine calls ``arm = policy.select({"step": s, "domain": d, ...})`` then
``policy.update(arm, reward(policy.reward_kind, ...), cost, context)``; a policy that lists
``"outcome"`` in ``outcome_keys`` also gets the finished step's drafts tried and accepted per
row there (:class:`StepOutcome`), and every policy is told what its arms are (``bind_arms``).
"""
from flashspec.bandits.base import Policy, StepOutcome
from flashspec.bandits.contextual import PerDomain
from flashspec.bandits.exp3 import EXP3
from flashspec.bandits.index import UCB1, EpsilonGreedy, FixedArm, Oracle, SlidingWindowUCB
from flashspec.bandits.rate import RateThompson
from flashspec.bandits.rewards import REWARD_KINDS, reward
from flashspec.bandits.shared import SharedDepthThompson
from flashspec.bandits.thompson import DiscountedThompson, ThompsonSampling

__all__ = ["Policy", "FixedArm", "EpsilonGreedy", "UCB1", "ThompsonSampling", "SlidingWindowUCB",
           "DiscountedThompson", "RateThompson", "SharedDepthThompson", "EXP3", "Oracle",
           "PerDomain", "StepOutcome", "reward", "REWARD_KINDS"]
