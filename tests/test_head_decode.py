"""experiment=head_decode's ratios (pure functions) and the bandit stream figure helpers."""
import math

import pytest

from experiments.head_decode import _step_seconds, head_rows, loop_stats, phase_seconds
from experiments.harness import config_arms
from flashspec.analysis.bandit_stream_plot import stream
from flashspec.core import Arm
from flashspec.theory import rho_tps


def _summary(tau_full, tps_full, tau_low, tps_low):
    return [{"dataset": "humaneval", "method": "spec:e[full]@3", "tau": tau_full, "tps": tps_full},
            {"dataset": "humaneval", "method": "spec:e[low]@3", "tau": tau_low, "tps": tps_low},
            {"dataset": "humaneval", "method": "ar", "tau": 1.0, "tps": 40.0}]


def test_head_rows_ratios_and_prediction():
    methods = {"full": "spec:e[full]@3", "low": "spec:e[low]@3"}
    # step 40 ms of which 3 x 4 ms full head: kappa = 12 / 28
    rows = head_rows(_summary(2.0, 50.0, 1.9, 55.0), {"full": 0.004, "low": 0.0008},
                     {"humaneval": 0.040}, 3, methods)
    low = next(r for r in rows if r["variant"] == "low")
    assert math.isclose(low["kappa"], 12 / 28)
    assert math.isclose(low["nu"], 0.2) and math.isclose(low["rho_tau"], 0.95)
    assert math.isclose(low["rho_tps_pred"], rho_tps(0.95, 0.2, 12 / 28))
    assert math.isclose(low["rho_tps_meas"], 1.1)
    full = next(r for r in rows if r["variant"] == "full")
    assert full["rho_tau"] == 1.0 and full["rho_tps_pred"] == pytest.approx(1.0)


def test_head_rows_measure_decode_throughput_and_heads_in_the_loop():
    methods = {"full": "spec:e[full]@3", "low": "spec:e[low]@3"}
    recs = [{"dataset": "humaneval", "method": methods["full"], "n_new_tokens": 100, "decode_s": 2.0,
             "wall_s": 2.5, "steps": 50, "head_s": 0.6, "head_calls": 150},   # 4 ms a call, 12 a step
            {"dataset": "humaneval", "method": methods["low"], "n_new_tokens": 100, "decode_s": 1.6,
             "wall_s": 2.1, "steps": 52, "head_s": 0.156, "head_calls": 156},  # 1 ms a call
            {"dataset": "humaneval", "method": "ar", "n_new_tokens": 100, "decode_s": 3.0,
             "wall_s": 3.5, "steps": 100}]
    loop = loop_stats(recs)
    assert set(loop) == {("humaneval", methods["full"]), ("humaneval", methods["low"])}
    rows = head_rows(_summary(2.0, 50.0, 1.9, 55.0), {"full": 0.004, "low": 0.0008},
                     {"humaneval": 0.040}, 3, methods, phase_seconds(recs), loop)
    low = next(r for r in rows if r["variant"] == "low")
    assert low["rho_tps_meas"] == pytest.approx(1.25) and low["rho_tps_meas_wall"] == pytest.approx(1.1)
    # prefill 0.5 s + decode 2 s of the full head; the variant's decode is 2 s / predicted ratio
    pred = low["rho_tps_pred_loop"]
    assert low["rho_tps_pred_wall"] == pytest.approx(2.5 / (0.5 + 2.0 / pred))
    assert low["nu_loop"] == pytest.approx(0.25) and low["kappa_loop"] == pytest.approx(0.012 / 0.028)
    assert low["rho_tps_pred_loop"] == pytest.approx(rho_tps(0.95, 0.25, 0.012 / 0.028))
    assert "nu_loop" not in head_rows(_summary(2.0, 50.0, 1.9, 55.0), {"full": 0.004, "low": 0.0008},
                                      {"humaneval": 0.040}, 3, methods)[1]


def test_timed_head_times_only_while_on():
    import torch
    from experiments.head_decode import TimedHead
    lin = torch.nn.Linear(4, 3)
    clock = TimedHead(lin)
    h = torch.randn(2, 4)
    assert torch.equal(clock(h), lin(h)) and clock.calls == 0
    clock.on = True
    clock(h)
    clock(h)
    assert clock.calls == 2 and clock.seconds > 0


def test_step_seconds_is_a_ratio_of_sums():
    recs = [{"method": "m", "dataset": "d", "decode_s": 1.0, "steps": 10},
            {"method": "m", "dataset": "d", "decode_s": 3.0, "steps": 10},
            {"method": "other", "dataset": "d", "decode_s": 9.0, "steps": 1}]
    assert _step_seconds(recs, "m") == {"d": 0.2}


def test_config_arms_follow_the_engine_order():
    explicit = {"drafters": {"a": {}, "b": {}}, "arms": [["b", 2], ["a", 3]]}
    assert config_arms(explicit) == [Arm("b", 2), Arm("a", 3)]
    product = {"drafters": {"a": {}, "b": {}}, "gammas": [2, 4], "arms": None}
    assert config_arms(product) == [Arm("a", 2), Arm("a", 4), Arm("b", 2), Arm("b", 4)]


def test_stream_concatenates_steps_of_one_method():
    recs = [{"method": "x", "domain": "code", "arms": [0, 1], "rewards": [0.5, 0.25]},
            {"method": "y", "domain": "chat", "arms": [1], "rewards": [1.0]},
            {"method": "x", "domain": "chat", "arms": [2], "rewards": [0.0]}]
    s = stream(recs, "x")
    assert s == {"reward": [0.5, 0.25, 0.0], "arm": [0, 1, 2], "domain": ["code", "code", "chat"]}


def test_ngram_hit_feature_and_contextual_keys():
    from flashspec.bandits.contextual import PerDomain
    from flashspec.drafters import HostFacts
    from flashspec.drafters.ngram import NgramDrafter

    def features(rows, finished=None):
        return NgramDrafter(3, 1).features([list(r) for r in rows], finished or [False] * len(rows))

    def hit(rows, finished=None):
        return features(rows, finished)["ngram_hit"]

    def match(rows, finished=None):
        return features(rows, finished)["ngram_match"]

    assert isinstance(NgramDrafter(), HostFacts)
    assert hit([[5, 6, 7, 5]]) and match([[5, 6, 7, 5]]) == 1    # 5 seen before: copy 6
    assert not hit([[5, 6, 7, 8]]) and match([[5, 6, 7, 8]]) == 0
    assert not hit([[5, 6, 7, 5], [1, 2]])                         # all live rows must hit
    assert hit([[5, 6, 7, 5], [1, 2]], [False, True])              # live rows only
    # the longest suffix with an earlier occurrence, capped at max_ngram, shortest over rows
    assert match([[1, 2, 3, 4, 9, 2, 3]]) == 2
    assert match([[1, 2, 3, 4, 9, 1, 2, 3, 4]]) == 3
    assert match([[1, 2, 3, 4, 9, 1, 2, 3, 4], [7, 8, 7]]) == 1
    assert PerDomain(2, key="ngram_hit").context_keys == ("ngram_hit",)
