"""The gate's statistics: exact warped target probabilities (float64, written independently of
``flashspec.verify.sampling``), χ² goodness-of-fit with merged bins, two-sample KS, and
``gate``, the single pass/fail decision shared by the pass tests and the planted-bug tests."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from scipy import stats

ALPHA = 0.01          # family-wise level of one gate (Bonferroni over its 2·T tests)
MIN_EXPECTED = 5.0    # χ² bins are merged until each expects at least this many samples


def exact_target_probs(logits: torch.Tensor, temperature: float, top_k: int = 0,
                       top_p: float = 1.0) -> np.ndarray:
    """Warped target probabilities [..., V] in float64: softmax(top-p(top-k(logits / T)))."""
    if temperature <= 0:
        raise ValueError("the gate is for stochastic sampling (temperature > 0)")
    x = logits.double() / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        probs = torch.softmax(x, dim=-1)
        order = torch.argsort(probs, dim=-1, descending=True, stable=True)
        sorted_p = probs.gather(-1, order)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= top_p)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1).numpy()


def sample_reference(probs: np.ndarray, n: int, seed: int) -> np.ndarray:
    """``n`` plain target samples per position: [n, P] token ids drawn from ``probs`` [P, V]."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(len(p), size=n, p=p / p.sum()) for p in probs], axis=1)


def merged_bins(expected: np.ndarray) -> np.ndarray:
    """Bin id per token (−1 for p = 0): tokens by descending expectation, grouped greedily
    until a bin expects ``MIN_EXPECTED``; a short tail joins the last bin."""
    order = np.argsort(-expected, kind="stable")
    order = order[expected[order] > 0]
    bins = np.full(expected.shape, -1, dtype=np.int64)
    acc, current = 0.0, 0
    for tok in order:
        bins[tok] = current
        acc += expected[tok]
        if acc >= MIN_EXPECTED:
            acc, current = 0.0, current + 1
    if acc > 0 and current > 0:          # unfinished tail: merge into the previous bin
        bins[bins == current] = current - 1
    return bins


def chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    """χ² goodness-of-fit of token ``samples`` against exact ``probs`` (merged small bins).
    Any sample on a p = 0 token gives p-value 0."""
    vocab = probs.shape[0]
    counts = np.bincount(samples, minlength=vocab).astype(np.float64)
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs / probs.sum() * len(samples)
    bins = merged_bins(expected)
    n_bins = int(bins.max()) + 1
    if n_bins < 2:
        return 1.0
    obs = np.bincount(bins[bins >= 0], weights=counts[bins >= 0], minlength=n_bins)
    exp = np.bincount(bins[bins >= 0], weights=expected[bins >= 0], minlength=n_bins)
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def ks_pvalue(samples: np.ndarray, reference: np.ndarray, probs: np.ndarray) -> float:
    """Two-sample KS on token ranks (tokens ordered by descending exact probability)."""
    rank = np.empty(probs.shape[0], dtype=np.int64)
    rank[np.argsort(-probs, kind="stable")] = np.arange(probs.shape[0])
    return float(stats.ks_2samp(rank[samples], rank[reference], method="asymp").pvalue)


@dataclass
class GateResult:
    """Per-position p-values and the verdict of one gate."""

    ks: list[float] = field(default_factory=list)
    chi2: list[float] = field(default_factory=list)
    invalid: int = 0
    alpha: float = ALPHA

    @property
    def threshold(self) -> float:
        return self.alpha / max(1, len(self.ks) + len(self.chi2))

    @property
    def min_p(self) -> float:
        return min(self.ks + self.chi2, default=1.0)

    @property
    def passed(self) -> bool:
        return self.invalid == 0 and self.min_p >= self.threshold

    def summary(self) -> str:
        return (f"{'PASS' if self.passed else 'FAIL'} invalid={self.invalid} "
                f"min_p={self.min_p:.3g} thr={self.threshold:.3g} "
                f"ks={_fmt(self.ks)} chi2={_fmt(self.chi2)}")


def _fmt(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.3g}" for x in xs) + "]"


def gate(spec: np.ndarray, reference: np.ndarray, probs: np.ndarray,
         alpha: float = ALPHA) -> GateResult:
    """Exactness gate on speculative tokens ``spec`` [N, T] vs plain target samples
    ``reference`` [N, T] and exact probabilities ``probs`` [≥T, V]: per position a two-sample KS
    and a χ² goodness-of-fit; pass iff no invalid token and every p-value ≥ alpha / (2T)."""
    vocab = probs.shape[-1]
    bad = (spec < 0) | (spec >= vocab)
    result = GateResult(invalid=int(bad.sum()), alpha=alpha)
    spec = np.where(bad, 0, spec)
    for t in range(spec.shape[1]):
        result.ks.append(ks_pvalue(spec[:, t], reference[:, t], probs[t]))
        result.chi2.append(chi2_pvalue(spec[:, t], probs[t]))
    return result
