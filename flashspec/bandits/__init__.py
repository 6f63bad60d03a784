"""Online drafter selection: K-armed bandit policies over (drafter, γ) arms.

Usage (engine): ``policy = from_config(cfg.bandit, n_arms, seed)``; each speculative step
``arm = policy.select({"step": s, "domain": d})`` then ``policy.update(arm, reward(...), cost,
context)`` (or ``policy.update_all([...])`` when every arm's outcome is known).
"""
from flashspec.bandits.base import Policy
from flashspec.bandits.contextual import PerDomain
from flashspec.bandits.exp3 import EXP3
from flashspec.bandits.factory import POLICIES, from_config, make_policy
from flashspec.bandits.index import UCB1, EpsilonGreedy, FixedArm, Oracle, SlidingWindowUCB
from flashspec.bandits.rate import RateThompson
from flashspec.bandits.rewards import REWARD_KINDS, reward
from flashspec.bandits.thompson import DiscountedThompson, ThompsonSampling

__all__ = ["Policy", "FixedArm", "EpsilonGreedy", "UCB1", "ThompsonSampling", "SlidingWindowUCB",
           "DiscountedThompson", "RateThompson", "EXP3", "Oracle", "PerDomain", "POLICIES", "make_policy",
           "from_config", "reward", "REWARD_KINDS"]
