"""Gate scenarios: build tables, run speculative sampling with a verify function, and gate the
result against exact probabilities and plain target samples."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from exactness.harness import Chooser, SpecRun, TableDrafter, VerifyFn, speculative_sample
from exactness.stats import GateResult, exact_target_probs, gate, sample_reference
from exactness.tables import make_draft, make_target
from flashspec.core import SamplingParams


@dataclass(frozen=True)
class ArmSpec:
    """One drafter of a case: its q table's overlap with p, its γ, full or one-hot q."""

    overlap: float = 0.95
    gamma: int = 3
    one_hot: bool = False
    scale_q: float = 2.5


@dataclass(frozen=True)
class Case:
    """One gate scenario (N rows, ``length`` tokens each, vocabulary ``vocab``)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    arms: tuple[ArmSpec, ...] = (ArmSpec(),)
    vocab: int = 256
    length: int = 5
    n_rows: int = 10_000
    scale_p: float = 2.5
    seed: int = 0

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    @property
    def positions(self) -> int:
        return self.length + max(a.gamma for a in self.arms)

    def name(self) -> str:
        arms = "+".join(f"{'1hot' if a.one_hot else 'q'}{a.overlap}g{a.gamma}" for a in self.arms)
        peak = "" if self.scale_p == 2.5 else f"-s{self.scale_p}"
        return (f"T{self.temperature}-k{self.top_k}-p{self.top_p}-{arms}-V{self.vocab}"
                f"-N{self.n_rows}-L{self.length}{peak}")


def build(case: Case) -> tuple[torch.Tensor, list[TableDrafter]]:
    """Target table [P, V] and the case's drafters (each arm gets its own q table)."""
    target, z = make_target(case.vocab, case.positions, case.scale_p, seed=case.seed)
    drafters = [TableDrafter(make_draft(z, a.overlap, a.scale_q, seed=case.seed + 1 + i),
                             a.gamma, a.one_hot) for i, a in enumerate(case.arms)]
    return target, drafters


def run_case(case: Case, verify_fn: VerifyFn, chooser: Chooser | None = None,
             drafters: list | None = None, progress: bool = False
             ) -> tuple[GateResult, SpecRun]:
    """Speculative tokens with ``verify_fn`` vs exact target probabilities: the gate verdict."""
    target, built = build(case)
    run = speculative_sample(target, drafters or built, case.params, case.n_rows, case.length,
                             verify_fn, case.seed, chooser, progress)
    probs = exact_target_probs(target[:case.length], case.temperature, case.top_k, case.top_p)
    reference = sample_reference(probs, case.n_rows, case.seed + 12345)
    return gate(run.tokens, reference, probs), run
