"""Thompson sampling over what arms share: per-depth acceptance of each drafter.

Arms (drafter, γ) of one drafter are not independent. One verified chain of γ drafts with n
accepted reveals the drafter's acceptance at every depth it reached: depths 1..n accepted and,
when n < γ, depth n + 1 rejected. Per-depth conditional rates α_d = P(depth d accepted | depth
d − 1 accepted) then predict every γ of that drafter: the expected accepted drafts of a chain
of γ are E[n | γ] = Σ_{k=1..γ} Π_{d<=k} α_d (Leviathan et al. 2023 with a rate per depth
instead of one α), so the tokens a step commits per row are 1 + E[n | γ]. An arm never played
is predicted from its siblings' steps, which is why this explores far less than a policy that
learns every arm on its own (:class:`flashspec.bandits.ThompsonSampling`).

A draft tree's accepted path is longer than its drafter's chain of the same depth, so a tree
arm keeps per-depth rates of its own (the path survives depth d given it reached d), learned
from that tree's steps only: the same expected-tokens formula, no sharing. The plain target
step (arm ``ar``) commits exactly one token per row. Arms the policy was not told about
(:meth:`bind_arms` not called, e.g. a policy built alone in a test) share nothing and keep the
per-arm rule of :class:`~flashspec.bandits.ThompsonSampling`.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from flashspec.bandits.base import Context, Policy, StepOutcome
from flashspec.core import Arm, TreeShape
from flashspec.errors import FlashSpecError

SHARED_REWARDS = ("alpha", "tps")


def expected_accepted(alphas: np.ndarray) -> np.ndarray:
    """``[..., D]`` per-depth conditional rates -> ``[..., D + 1]`` expected accepted drafts
    of a chain of γ = 0..D: E[n | γ] = Σ_{k<=γ} Π_{d<=k} α_d."""
    survive = np.cumprod(alphas, axis=-1)            # P(at least k drafts accepted)
    zero = np.zeros(alphas.shape[:-1] + (1,))
    return np.concatenate([zero, np.cumsum(survive, axis=-1)], axis=-1)


def depth_counts(tried: np.ndarray, accepted: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-depth evidence of chain steps, summed over the last axis (rows): ``[..., depth]``
    (reached, accepted). A row that verified ``tried`` = k drafts and accepted n reached depths
    1..min(n + 1, k) and was accepted at depths 1..n."""
    d = np.arange(1, depth + 1)
    reached = (d <= np.minimum(accepted + 1, tried)[..., None]).sum(axis=-2)
    won = (d <= accepted[..., None]).sum(axis=-2)
    return reached.astype(float), won.astype(float)


class SharedDepthThompson(Policy):
    """Thompson sampling from Beta posteriors of each drafter's per-depth acceptance rates.

    Each step, per replicate, draws α_d ~ Beta(prior_alpha + accepted_d, prior_beta + reached_d
    − accepted_d) for every drafter (and tree shape) and depth, and plays the arm with the
    largest predicted reward under that draw:

    - ``reward: alpha``: E[n | γ] / γ, the expected fraction of drafts accepted;
    - ``reward: tps``: (1 + E[n | γ]) / cost, committed tokens per second of step time per row,
      with cost the arm's mean measured step time (the ``cost`` ``update`` is given: the step's
      seconds). An arm not yet played borrows its cost (:meth:`arm_costs`) from its drafter's
      other chains, else from arms of the same depth; one with nothing to borrow from is
      played once. This is pooled tokens over pooled time, the rate a throughput run
      measures (see :mod:`flashspec.bandits.rate`), not the mean of per-step tok/s.

    ``update`` reads ``context["outcome"]`` (a :class:`~flashspec.bandits.base.StepOutcome`,
    :attr:`outcome_keys`): the drafts each row verified and accepted in the finished step. For
    a drafter's arm the reward value itself is not used: the outcome carries more (which depth
    failed), and the reward follows from it and the cost (:func:`~flashspec.bandits.reward`).
    ``arms``: what each arm is (:class:`~flashspec.core.Arm`, or its label or config pair, as
    :meth:`~flashspec.core.Arm.parse` reads them: ``d@3``, ``[d, 3]``); the engine
    supplies them through :meth:`bind_arms`.
    """

    name = "shared"

    def __init__(self, n_arms: int, seed: int | Sequence[int] = 0,
                 arms: Sequence[Arm | str | Sequence[Any]] | None = None,
                 prior_alpha: float = 1.0, prior_beta: float = 1.0, **kw: Any) -> None:
        super().__init__(n_arms, seed, **kw)
        if self.reward_kind not in SHARED_REWARDS:
            raise FlashSpecError(f"bandit={self.name}: bandit.reward={self.reward_kind!r} is not "
                                 f"predicted from acceptance; choose one of {SHARED_REWARDS}")
        if not (prior_alpha > 0 and prior_beta > 0):
            raise FlashSpecError(f"bandit={self.name}: prior_alpha={prior_alpha} and "
                                 f"prior_beta={prior_beta} must be > 0")
        self.prior_alpha, self.prior_beta = float(prior_alpha), float(prior_beta)
        shape = (self.n_envs, self.n_arms)
        self._succ, self._fail = np.zeros(shape), np.zeros(shape)   # per-arm rule's trials
        self.groups: list[tuple[str, TreeShape | None]] = []   # (drafter, tree or None: chains)
        self.group_of = np.full(self.n_arms, -1)          # -1: no group (plain step or unbound)
        self.depth_of = np.zeros(self.n_arms, dtype=np.int64)
        self.plain = np.zeros(self.n_arms, dtype=bool)    # the target-only step: one token
        self._chain_group: dict[str, int] = {}
        self._reach = np.zeros((self.n_envs, 0, 0))
        self._won = np.zeros((self.n_envs, 0, 0))
        if arms is not None:
            self.bind_arms([Arm.parse(a) for a in arms])

    @property
    def outcome_keys(self) -> tuple[str, ...]:
        return ("outcome",)

    def bind_arms(self, arms: Sequence[Arm]) -> None:
        """Groups arms by what they share; rebinding the same arms (a new engine over the
        same policy) keeps what was learned, other arms after a step are refused."""
        if self.arm_specs is not None and list(arms) == self.arm_specs:
            return
        if self.t:
            raise FlashSpecError(f"bandit={self.name}: arms were rebound after {self.t} steps")
        super().bind_arms(arms)
        depth: dict[tuple[str, TreeShape | None], int] = {}
        for a in arms:
            if a.drafter is None:
                continue
            chain = (a.drafter, None)   # a tree arm may be played as a chain of its drafter
            depth[chain] = max(depth.get(chain, 0), a.gamma)
            if a.tree is not None:
                depth[(a.drafter, a.tree)] = a.gamma
        self.groups = list(depth)
        self._chain_group = {d: g for g, (d, tree) in enumerate(self.groups) if tree is None}
        index = {key: g for g, key in enumerate(self.groups)}
        for i, a in enumerate(arms):
            self.plain[i] = a.drafter is None
            self.group_of[i] = -1 if a.drafter is None else index[(a.drafter, a.tree)]
            self.depth_of[i] = a.gamma
        width = max(depth.values(), default=0)
        self.group_depth = np.array([depth[k] for k in self.groups], dtype=np.int64)
        self._reach = np.zeros((self.n_envs, len(self.groups), width))
        self._won = np.zeros((self.n_envs, len(self.groups), width))

    # ---------------------------------------------------------------- scoring
    def _scores(self, context: Context) -> np.ndarray:
        a = self.prior_alpha + self._won
        b = self.prior_beta + self._reach - self._won
        alphas = np.stack([g.beta(a[i], b[i]) for i, g in enumerate(self.rngs)]) \
            if self._reach.size else self._reach
        alone = self._alone()
        if alone.any():
            draw = np.stack([g.beta(self.prior_alpha + self._succ[i, alone],
                                    self.prior_beta + self._fail[i, alone])
                             for i, g in enumerate(self.rngs)])
        else:
            draw = np.zeros((self.n_envs, 0))
        return self._predict(alphas, draw)

    def _estimates(self) -> np.ndarray:
        alphas = (self.prior_alpha + self._won) / (self.prior_alpha + self.prior_beta + self._reach)
        alone = self._alone()
        mean = (self.prior_alpha + self._succ[:, alone]) / (
            self.prior_alpha + self.prior_beta + self._succ[:, alone] + self._fail[:, alone])
        return self._predict(alphas, mean)

    def _alone(self) -> np.ndarray:
        """Arms that share nothing (not told what they are): the per-arm rule."""
        return (self.group_of < 0) & ~self.plain

    def _predict(self, alphas: np.ndarray, alone_rate: np.ndarray) -> np.ndarray:
        """``[n_envs, K]`` reward of each arm under per-depth rates ``alphas`` ``[n_envs, G, D]``
        and the per-arm rates of the arms that share nothing."""
        out = np.zeros((self.n_envs, self.n_arms))
        grouped = self.group_of >= 0
        if grouped.any():
            exp_n = expected_accepted(alphas)               # [n_envs, G, D + 1]
            out[:, grouped] = exp_n[:, self.group_of[grouped], self.depth_of[grouped]]
        if self.reward_kind == "alpha":
            out = np.divide(out, self.depth_of, out=np.zeros_like(out), where=self.depth_of > 0)
        else:
            modelled = grouped | self.plain
            cost = self.arm_costs()[:, modelled]
            out[:, modelled] = np.where(np.isnan(cost), np.inf,   # unmeasured: play it once
                                        (1.0 + out[:, modelled]) / np.nan_to_num(cost, nan=1.0))
        out[:, self._alone()] = self.reward_scale * alone_rate
        return out

    def arm_costs(self) -> np.ndarray:
        """``[n_envs, K]`` step cost of each arm: its own mean; else, for a chain, the line
        through the mean costs of its drafter's played chains (two depths or more: drafting
        cost grows with γ); else the mean over played arms of the same depth and tree shape
        (other drafters); else NaN, and the arm is played once to measure it."""
        played = self._counts > 0
        own = np.divide(self._cost_sums, self._counts, out=np.full_like(self._cost_sums, np.nan),
                        where=played)
        cost = own.copy()
        specs = self.arm_specs or []
        for i, spec in enumerate(specs):
            if played[:, i].all():
                continue
            peers = [j for j, s in enumerate(specs) if (s.gamma, s.tree) == (spec.gamma, spec.tree)]
            n = self._counts[:, peers].sum(axis=1)
            like = np.divide(self._cost_sums[:, peers].sum(axis=1), n,
                             out=np.full(self.n_envs, np.nan), where=n > 0)
            line = self._cost_line(spec, own, played) if spec.drafter is not None \
                and spec.tree is None else np.full(self.n_envs, np.nan)
            guess = np.where(np.isnan(line), like, line)
            cost[:, i] = np.where(played[:, i], own[:, i], guess)
        return cost

    def _cost_line(self, spec: Arm, own: np.ndarray, played: np.ndarray) -> np.ndarray:
        """``[n_envs]`` least-squares line of cost against γ over the played chains of
        ``spec``'s drafter, read at ``spec.gamma`` (NaN with fewer than two depths played)."""
        sib = [j for j, s in enumerate(self.arm_specs)
               if s.drafter == spec.drafter and s.tree is None]
        x = self.depth_of[sib].astype(float)[None, :]
        m = played[:, sib].astype(float)
        y = np.nan_to_num(own[:, sib])
        n, sx, sy = m.sum(1), (m * x).sum(1), (m * y).sum(1)
        sxx, sxy = (m * x * x).sum(1), (m * x * y).sum(1)
        spread = n * sxx - sx * sx          # > 0 iff two distinct depths were played
        ok = spread > 1e-9
        slope = np.divide(n * sxy - sx * sy, spread, out=np.zeros_like(n), where=ok)
        icept = np.divide(sy - slope * sx, n, out=np.zeros_like(n), where=ok)
        return np.where(ok, np.maximum(icept + slope * spec.gamma, 1e-12), np.nan)

    # ---------------------------------------------------------------- learning
    def _observe(self, r: np.ndarray, c: np.ndarray, pulled: np.ndarray | None, context: Context) -> None:
        u = self.uniforms.take(self.n_arms)   # the per-arm rule's Bernoulli trials
        seen = ~np.isnan(r) & self._alone()[None, :]
        win = seen & (u < np.nan_to_num(self.unit(r)))
        self._succ += win
        self._fail += seen & ~win
        if pulled is not None:
            self._fold(pulled, (context or {}).get("outcome"))
        super()._observe(r, c, pulled, context)

    def _fold(self, pulled: np.ndarray, outcome: StepOutcome | None) -> None:
        """Adds one step's per-depth evidence to the group of the arm each replicate played."""
        group = self.group_of[pulled]
        if outcome is None:
            if (group >= 0).any():
                raise FlashSpecError(f"bandit={self.name}: update() of a drafter's arm needs "
                                     "context['outcome'] (a StepOutcome: drafts tried and "
                                     "accepted per row); the engine passes it")
            return
        tried = np.asarray(outcome.tried, dtype=np.int64).reshape(self.n_envs, -1)
        accepted = np.asarray(outcome.accepted, dtype=np.int64).reshape(self.n_envs, -1)
        if outcome.chain:   # a tree arm played as a chain of its drafter
            group = np.array([self._chain_group[self.groups[g][0]] if g >= 0 else -1
                              for g in group])
        top = np.where(group >= 0, self.depth_of[pulled], 0)
        if (accepted < 0).any() or (accepted > tried).any() or (tried > top[:, None]).any():
            raise FlashSpecError(f"bandit={self.name}: step outcome needs 0 <= accepted <= tried "
                                 f"<= the arm's depth; got tried={tried.tolist()}, "
                                 f"accepted={accepted.tolist()}, depth={top.tolist()}")
        if not self._reach.size:
            return
        reached, won = depth_counts(tried, accepted, self._reach.shape[2])
        rows = np.flatnonzero(group >= 0)
        self._reach[rows, group[rows]] += reached[rows]
        self._won[rows, group[rows]] += won[rows]

    # ---------------------------------------------------------------- logging
    @property
    def depth_rates(self) -> dict[str, list]:
        """Posterior mean α per depth of each drafter (``name``) and tree (its arm's label)."""
        mean = (self.prior_alpha + self._won) / (self.prior_alpha + self.prior_beta + self._reach)
        mean = self._squeeze(mean)
        return {d if t is None else Arm(d, tree=t).label: mean[..., g, :self.group_depth[g]].tolist()
                for g, (d, t) in enumerate(self.groups)}
