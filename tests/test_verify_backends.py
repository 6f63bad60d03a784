"""The verify-backend registry: capabilities, lookup, and a new backend added from outside.

``wrapped_reference`` below is how a new backend is added: its own module defines a factory
``make(options) -> Backend`` and registers it (or a config names "module:factory"); nothing in
flashspec changes. It then passes the same statistical exactness gate as the built-ins.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))   # the tests/exactness helpers

from exactness.cases import ArmSpec, Case, run_case  # noqa: E402
from flashspec.core import Arm, SamplingParams
from flashspec.drafters import NgramDrafter  # noqa: E402
from flashspec.engine import SpecEngine
from flashspec.models.llama import LlamaLM, LlamaShape  # noqa: E402
from flashspec.options import KernelOptions  # noqa: E402
from flashspec.verify import Backend, backend_names, get_backend, reference, register_backend

CALLS: list[int] = []


def make_wrapped(options: KernelOptions) -> Backend:
    """A trivial backend: the reference, counting its calls."""
    def verify(*args, **kwargs):
        CALLS.append(1)
        return reference.verify(*args, **kwargs)
    return Backend("wrapped_reference", verify, graph_safe=False,
                   dtypes=(torch.float32, torch.bfloat16, torch.float16))


register_backend("wrapped_reference", make_wrapped, replace=True)


def test_builtins_state_their_capabilities():
    torch_b, triton_b = get_backend("torch"), get_backend("triton", KernelOptions())
    assert {"torch", "triton", "wrapped_reference"} <= set(backend_names())
    plain, warped = SamplingParams(1.0), SamplingParams(1.0, top_k=20)
    assert not torch_b.fuses_in_graph(plain) and not torch_b.fuses_in_graph(warped)
    assert triton_b.fuses_in_graph(plain) and not triton_b.fuses_in_graph(warped)
    assert triton_b.fuses_in_graph(SamplingParams(0.0))
    assert not triton_b.fuses_in_graph(SamplingParams(1.0, top_p=0.9))
    assert torch.float64 not in triton_b.dtypes and torch.bfloat16 in triton_b.dtypes


def test_lookup_by_name_path_or_object():
    b = get_backend("wrapped_reference")
    assert get_backend(b) is b
    assert get_backend("test_verify_backends:make_wrapped").name == "wrapped_reference"
    with pytest.raises(ValueError, match="unknown verify backend"):
        get_backend("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_backend("torch", make_wrapped)


def test_new_backend_passes_the_exactness_gate():
    CALLS.clear()
    case = Case(0.7, arms=(ArmSpec(gamma=2),))
    result, run = run_case(case, get_backend("wrapped_reference"))
    assert CALLS and 0 < run.alpha < 1
    assert result.passed, result.summary()


def test_engine_takes_a_backend_object():
    shape = LlamaShape(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, max_positions=128)
    torch.manual_seed(0)
    model = LlamaLM(shape, 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.eval().requires_grad_(False)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5, 6, 5]]
    params = SamplingParams(1.0)

    def run(backend):
        engine = SpecEngine(model, [Arm("ngram", 3)], params=params, backend=backend,
                            seed=3, drafters=[NgramDrafter()])
        return [r.tokens for r in engine.generate(prompts, 12).rows]

    CALLS.clear()
    assert run(get_backend("wrapped_reference")) == run("torch") and CALLS
