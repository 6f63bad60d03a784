"""Statistical exactness gate at the verify level.

Speculative sampling must leave the output distributed exactly as plain sampling from the
target. N = 10,000 independent rows run ragged multi-step speculative sampling over synthetic,
context-free target/draft logit tables (tests/exactness/harness.py); per position the
speculative tokens are compared with plain target samples (two-sample KS) and with the exact
warped target probabilities (χ², small bins merged), family-wise α = 0.01 per gate.

Power: the very same gate must fail on planted bugs (tests/exactness/planted.py, choosers.py),
each failure asserted below. Everything is seeded: results are deterministic.
"""
from __future__ import annotations

import os
from importlib.util import find_spec

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():                          # before triton kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

# tests/exactness: importable as `exactness` because pytest puts tests/ (no __init__.py) on sys.path
from exactness.cases import ArmSpec, Case, build, run_case  # noqa: E402
from exactness.choosers import PeekingDrafter, PolicyChooser, SwitchOnRejectChooser  # noqa: E402
from exactness.planted import BUGS, make_verify  # noqa: E402
from exactness.stats import exact_target_probs, gate, sample_reference  # noqa: E402
from flashspec.core import SamplingParams  # noqa: E402
from flashspec.verify import get_backend, warp_logprobs  # noqa: E402

ONE_HOT = ArmSpec(one_hot=True)

# torch backend: 10,000 rows, V = 256, 5 tokens per row; T × warps × q kind.
TORCH_CASES = [
    Case(1.0),
    Case(0.7),
    Case(1.5),
    Case(0.7, scale_p=6.0),                        # peaked target: top p 0.54..0.999 by position
    Case(1.0, arms=(ONE_HOT,)),
    Case(0.7, arms=(ArmSpec(overlap=0.7, one_hot=True),)),
    Case(0.7, top_k=20),
    Case(0.7, top_p=0.7, arms=(ArmSpec(gamma=2),)),
    Case(1.0, top_k=10, arms=(ArmSpec(gamma=1, one_hot=True),)),
    Case(1.5, top_p=0.9, arms=(ONE_HOT,)),
    Case(1.5, top_k=50, top_p=0.8, arms=(ArmSpec(overlap=0.7, gamma=4),)),
    Case(1.0, vocab=2500, length=3, arms=(ArmSpec(gamma=2),)),    # three race blocks
]
# triton (TRITON_INTERPRET=1 on CPU): same 10,000 rows; fused top-k path included.
TRITON_CASES = [
    Case(1.5, arms=(ArmSpec(gamma=2),)),
    Case(0.7, top_k=20, arms=(ArmSpec(gamma=2, one_hot=True),)),
    Case(1.0, top_k=50, arms=(ArmSpec(overlap=0.7, gamma=3),)),
]
BUG_CASE = TORCH_CASES[1]            # T = 0.7, full q: passes with the real verify (above)
BLOCK_CASE = TORCH_CASES[-1]         # several race blocks: where a block-level bug can show
BANDIT_ARMS = (ArmSpec(0.95, 3), ArmSpec(0.7, 1), ArmSpec(0.9, 2, one_hot=True))


def backend(name: str):
    """The verify function of backend ``name``; triton is skipped while it does not exist."""
    if name == "triton":
        if find_spec("flashspec.verify.triton_backend") is None:
            pytest.skip("flashspec/verify/triton_backend.py does not exist yet")
        from flashspec.verify import triton_backend
        assert triton_backend.INTERPRET or torch.cuda.is_available(), (
            "triton was imported before TRITON_INTERPRET=1 was set: the kernel would not run")
    return get_backend(name)


def _report(tag: str, result, run) -> None:
    print(f"\n[gate] {tag}: alpha={run.alpha:.3f} calls={run.calls} {result.summary()}")


@pytest.mark.parametrize("case,name", [(c, "torch") for c in TORCH_CASES]
                         + [pytest.param(c, "triton", marks=pytest.mark.slow) for c in TRITON_CASES],
                         ids=lambda x: x.name() if isinstance(x, Case) else x)
def test_gate_passes(case: Case, name: str) -> None:
    result, run = run_case(case, backend(name))
    _report(f"{name} {case.name()}", result, run)
    assert 0 < run.alpha < 1, "both acceptance and rejection paths must be exercised"
    assert result.passed, result.summary()


@pytest.mark.slow
def test_gate_passes_realistic_vocab() -> None:
    """V = 32,000 and 10,000 rows (γ = 1, 2 tokens per row keep it under a minute)."""
    case = Case(0.7, vocab=32_000, length=2, arms=(ArmSpec(gamma=1),))
    result, run = run_case(case, backend("torch"))
    _report(case.name(), result, run)
    assert run.calls > 1 and 0 < run.alpha < 1
    assert result.passed, result.summary()


@pytest.mark.parametrize("policy", ["ucb1", "thompson", "switch_on_reject", "ucb1_warm",
                                    "thompson_warm", "ucb1_tps_warm", "thompson_tps"])
def test_gate_passes_with_bandit_chosen_drafters(policy: str) -> None:
    """Each row's own chooser picks (q table, γ) every step from its past acceptance only:
    flashspec.bandits policies (one replicate per row) and a strongly history-dependent rule.
    ``*_warm``: the policy started from priors (``Policy.warm_start``, what a decode job reads
    from the priors store) that rate the weakest-overlap drafter above the best one: it is
    played more, and the output is still the target's. ``*_tps``: the policy on its tokens-
    per-cost rate (the decode configs' default reward)."""
    case = Case(1.0, arms=BANDIT_ARMS)
    name = policy.removesuffix("_warm")
    reward = "tps" if name.endswith("_tps") else "alpha"
    name = name.removesuffix("_tps")
    chooser = (SwitchOnRejectChooser(len(BANDIT_ARMS), case.n_rows) if name == "switch_on_reject"
               else PolicyChooser(name, len(BANDIT_ARMS), case.n_rows, seed=7, reward=reward))
    if policy.endswith("_warm"):
        scale = 2.0 if reward == "tps" else 1.0   # tokens per cost unit in [0, 4]
        chooser.policy.warm_start([20, 20, 0], [0.3 * scale, 0.9 * scale, 0.0], weight=20)
    result, run = run_case(case, backend("torch"), chooser=chooser)
    _report(f"chooser={policy} {case.name()} arm_steps={run.arm_steps}", result, run)
    played = [run.arm_steps.get(a, 0) for a in range(3)]
    assert len(chooser.history) >= 3
    assert (played[1] > played[0] and played[2] > 0) if policy.endswith("_warm") \
        else all(played), played
    assert result.passed, result.summary()


def test_gate_calibration_on_direct_samples() -> None:
    """The statistics alone: direct target samples pass; samples at T·1.05 (a 5 % temperature
    error) or with 1 % of the mass moved onto one p = 0 token fail."""
    target = build(Case(1.0))[0][:5]
    probs = exact_target_probs(target, 1.0)
    reference = sample_reference(probs, 10_000, seed=1)
    assert gate(sample_reference(probs, 10_000, seed=2), reference, probs).passed
    hotter = exact_target_probs(target, 1.05)
    assert not gate(sample_reference(hotter, 10_000, seed=2), reference, probs).passed
    leaked = sample_reference(probs, 10_000, seed=2)
    zero_tok = int(np.flatnonzero(probs[0] == 0)[0])
    leaked[:100, 0] = zero_tok
    assert not gate(leaked, reference, probs).passed


@pytest.mark.parametrize("bug", BUGS)
def test_gate_fails_on_planted_bug(bug: str) -> None:
    result, run = run_case(BLOCK_CASE if bug == "block_by_max" else BUG_CASE, make_verify(bug))
    _report(f"planted {bug}", result, run)
    assert not result.passed, f"the gate missed planted bug {bug}: {result.summary()}"


def test_gate_fails_when_policy_peeks_at_current_draft() -> None:
    """A chooser that reads this step's drafts and target breaks exactness: the gate sees it."""
    case = Case(1.0, arms=(ArmSpec(0.95, 3), ArmSpec(0.7, 3)))
    target, drafters = build(case)
    result, run = run_case(case, backend("torch"), drafters=[PeekingDrafter(drafters, target)])
    _report("planted peeking policy", result, run)
    assert not result.passed, result.summary()


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, 20, 0.9),
                                    SamplingParams(1.5, 0, 0.8)], ids=str)
@pytest.mark.parametrize("one_hot", [False, True])
def test_unbugged_variant_matches_reference(params: SamplingParams, one_hot: bool) -> None:
    """The planted variants differ from the library's rule by their bug alone."""
    gen = torch.Generator().manual_seed(3)
    batch, gamma, vocab = 64, 4, 2300
    target = 3 * torch.randn(batch, gamma + 1, vocab, generator=gen)
    target[:, :, :20] = float("-inf")
    draft = target[:, :gamma].nan_to_num(neginf=0.0) + torch.randn(batch, gamma, vocab, generator=gen)
    probs = warp_logprobs(draft, params).exp().reshape(-1, vocab)
    tokens = torch.multinomial(probs, 1, generator=gen).view(batch, gamma)
    dl = None if one_hot else draft
    ref = get_backend("torch")(target, tokens, dl, params, 11)
    out = make_verify(None)(target, tokens, dl, params, 11)
    assert 0 < ref[1].float().mean() < gamma, "inputs must exercise accept and reject"
    assert torch.equal(ref[0], out[0]) and torch.equal(ref[1], out[1])


# ---------------------------------------------------------------------------------------------
# ENGINE-LEVEL GATE: through flashspec's decode engine on the real SmolLM2 weights lives in
# tests/test_exactness_engine.py (owned by the engine author); it reuses exactness.stats
# (exact_target_probs, gate, sample_reference), so keep those signatures stable.
# ---------------------------------------------------------------------------------------------
