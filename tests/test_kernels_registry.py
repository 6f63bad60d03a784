"""The torch/Triton registry (:mod:`flashspec.kernels`): every op's two forms import, the rule
picks what each call site picked before it, and no other module decides by ``is_cuda``.

The tests run under Triton's interpreter (conftest.py sets TRITON_INTERPRET=1 before triton is
imported); the non-interpreter build is checked in a child process without it.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashspec import kernels
from flashspec.core import SamplingParams
from flashspec.kernels import CPU_NEEDS_INTERPRETER, CUDA_ONLY, OPS, TORCH, TRITON, choose
from flashspec.options import KernelOptions

ROOT = Path(__file__).resolve().parents[1]
GREEDY, TEMP, TOPK, TOPP = (SamplingParams(0.0), SamplingParams(1.0),
                            SamplingParams(1.0, top_k=5), SamplingParams(1.0, top_p=0.9))

# files of flashspec/ that may read ``.is_cuda``, each with why it is not a torch/Triton choice
IS_CUDA_ALLOWED = {
    "flashspec/kernels.py": "the registry: the one place that decides",
    "flashspec/training/train.py": "picks torch's own fused AdamW (a torch CUDA kernel, no "
                                   "Triton form)",
}
IS_CUDA = re.compile(r"\.is_cuda\b")


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: reaches the rules' CUDA branches without a GPU
    (only the rule reads it; nothing is launched)."""

    is_cuda = True


def on_cuda(x: torch.Tensor) -> torch.Tensor:
    return x.as_subclass(_OnCuda)


def logits(batch: int = 2, positions: int = 3, vocab: int = 50, dtype=torch.float32):
    return torch.zeros(batch, positions, vocab, dtype=dtype)


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_has_both_forms(name):
    for impl in (TORCH, TRITON):
        assert callable(kernels.implementation(name, impl)), (name, impl)


def test_interpreter_ops_take_cpu_tensors_under_the_interpreter():
    """The verify kernels and the fused decode layers run on CPU tensors when their kernels
    were built for the interpreter (they were: conftest)."""
    for name in ("verify", "tree_verify", "decode_layers"):
        assert kernels.interpreter_built(name), name
    x = logits()
    assert choose("verify", x, draft_logits=None, params=TEMP) == kernels.Choice(TRITON)
    assert choose("verify", x, draft_logits=x[:, :2], params=GREEDY).triton
    assert choose("tree_verify", x, draft_logits=None, params=TEMP).triton
    cache = object()
    assert choose("decode_layers", x, positions=torch.zeros(2, 3), cache=cache).triton


def test_cuda_only_ops_keep_torch_on_cpu_even_under_the_interpreter():
    """The tree kernels, the argmax/top-k kernels and the head kernel ran by default on CUDA
    only; the registry keeps that (tests call the kernels on CPU through ``force``)."""
    x = logits()
    w = torch.zeros(50, 4)
    cases = {"tree_growth": {}, "tree_selection": {}, "tree_compaction": {}, "argmax": {},
             "gumbel_argmax": {"params": TEMP}, "topk": {"params": GREEDY, "seed": None},
             "head_up": {"weight": w}}
    assert set(cases) | {"verify", "tree_verify", "decode_layers"} == set(OPS)
    opts = KernelOptions(head_triton=True)
    for name, facts in cases.items():
        u = torch.zeros(2, 4) if name == "head_up" else x
        assert choose(name, u, opts, **facts) == kernels.Choice(TORCH, CUDA_ONLY), name
        assert choose(name, on_cuda(u), opts, **facts).triton, name
        assert choose(name, u, force=True).triton and not choose(name, on_cuda(u),
                                                                  force=False).triton


def test_verify_reasons_keep_their_order_and_words():
    """The reasons the verify backend logs, first failing check first."""
    x = logits()
    why = lambda t, p=TEMP, q=None, o=KernelOptions(): choose("verify", t, o, draft_logits=q,
                                                              params=p).reason
    assert why(x, TOPP) == "top-p is not fused"
    assert why(logits(vocab=400), SamplingParams(1.0, top_k=300)) == "top-k > 256 is not fused"
    assert why(logits(vocab=200), SamplingParams(1.0, top_k=300)) is None   # k >= V: no warp
    assert why(x.double()) == "logits dtype torch.float64 is not fused (bf16/fp16/fp32 are)"
    assert why(x, q=x.double()[:, :2]).startswith("logits dtype torch.float64")
    huge = torch.zeros(1, 1, 1).expand(1, 1, 1 << 24)                  # no memory of its own
    assert why(huge) == "vocabularies of 2^24 or more tokens are not fused"
    tree = choose("tree_verify", x, draft_logits=None, params=TOPK).reason
    assert tree == "tree verify fuses temperature only (top-k/top-p are not fused)"


def test_fuse_topk_on_cuda_flips_the_verify_choice():
    """Top-k on CUDA falls back unless KernelOptions.fuse_topk_on_cuda; the interpreter (CPU)
    always fuses it."""
    x = logits()
    off, on = KernelOptions(), KernelOptions(fuse_topk_on_cuda=True)
    assert choose("verify", on_cuda(x), off, draft_logits=None, params=TOPK).reason == (
        "fused top-k is disabled on CUDA (mismatched the reference on an H200)")
    assert choose("verify", on_cuda(x), on, draft_logits=None, params=TOPK).triton
    assert choose("verify", x, off, draft_logits=None, params=TOPK).triton


def test_head_triton_flips_the_head_choice():
    u, w = torch.zeros(3, 4), torch.zeros(50, 4)
    off, on = KernelOptions(), KernelOptions(head_triton=True)
    assert choose("head_up", on_cuda(u), off, weight=w).reason == "KernelOptions.head_triton is off"
    assert choose("head_up", on_cuda(u), on, weight=w).triton
    assert not choose("head_up", on_cuda(torch.zeros(17, 4)), on, weight=w).triton  # > 16 rows
    assert not choose("head_up", on_cuda(u), on, weight=w.double()).triton        # dtype
    w.requires_grad_(True)
    assert not choose("head_up", on_cuda(u), on, weight=w).triton                  # autograd
    with torch.no_grad():
        assert choose("head_up", on_cuda(u), on, weight=w).triton


def test_draw_rules():
    """Argmax always; Gumbel draws and tree children only without top-k/top-p, and children
    only from a device seed (a torch.Generator's draws have no kernel)."""
    x, seed = on_cuda(logits()), torch.zeros((), dtype=torch.long)
    assert choose("argmax", x).triton
    assert choose("gumbel_argmax", x, params=TEMP).triton
    assert not choose("gumbel_argmax", x, params=TOPK).triton
    assert not choose("gumbel_argmax", x, params=TOPP).triton
    assert choose("topk", x, params=GREEDY, seed=None).triton
    assert choose("topk", x, params=TEMP, seed=seed).triton
    assert not choose("topk", x, params=TEMP, seed=None).triton
    assert not choose("topk", x, params=TOPK, seed=seed).triton


def test_decode_layers_rule():
    x, pos = logits(), torch.zeros(2, 3)
    assert not choose("decode_layers", x, positions=pos, cache=None).triton
    wide = torch.zeros(2, kernels.DECODE_MAX_TOKENS + 1)
    assert not choose("decode_layers", x, positions=wide, cache=object()).triton
    grad = x.clone().requires_grad_(True)
    assert not choose("decode_layers", grad, positions=pos, cache=object()).triton
    with torch.no_grad():
        assert choose("decode_layers", grad, positions=pos, cache=object()).triton


def test_without_the_interpreter_cpu_tensors_take_torch_and_never_import_triton():
    """A process whose triton was imported without TRITON_INTERPRET: CPU draws, trees and heads
    run in torch without importing triton at all, and the verify kernels and fused layers (whose
    modules import triton) fall back with the logged reason."""
    code = """
import sys, torch
from flashspec.core import SamplingParams
from flashspec.heads.modules import LowRankHead
from flashspec.kernels import choose
from flashspec.tree import pick_children
from flashspec.verify.sampling import sample
x = torch.randn(2, 50)
sample(x, SamplingParams(0.0)); sample(x, SamplingParams(1.0), seed=torch.tensor(3))
pick_children(x, 2, SamplingParams(0.0), None)
LowRankHead(torch.randn(4, 8), torch.randn(50, 4), use_triton=True)(torch.randn(2, 8))
assert "triton" not in sys.modules, "triton imported on the CPU path"
p = SamplingParams(1.0)
print(choose("verify", x[:, None], draft_logits=None, params=p).reason)
print(choose("tree_verify", x[:, None], draft_logits=None, params=p).reason)
print(choose("decode_layers", x[:, None], positions=torch.zeros(2, 1), cache=object()).reason)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [CPU_NEEDS_INTERPRETER] * 3


def is_cuda_dispatches(package: Path = ROOT / "flashspec") -> list[str]:
    """``file:line: code`` of every ``.is_cuda`` in the code (not comments or string literals)
    of a file of ``package`` outside :data:`IS_CUDA_ALLOWED`."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).as_posix()
        if rel in IS_CUDA_ALLOWED:
            continue
        source = path.read_text()
        strings: set[int] = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.update(range(node.lineno, node.end_lineno + 1))
        for i, line in enumerate(source.splitlines(), 1):
            if i not in strings and IS_CUDA.search(line.split("#", 1)[0]):
                found.append(f"{rel}:{i}: {line.strip()}")
    return found


def test_no_module_decides_by_is_cuda_on_its_own():
    """Torch-vs-Triton is decided by :func:`flashspec.kernels.choose` alone."""
    found = is_cuda_dispatches()
    assert not found, "decide through flashspec.kernels.choose, or allow-list with why:\n" + (
        "\n".join(found))


def test_the_grep_finds_a_planted_dispatch(tmp_path):
    pkg = tmp_path / "flashspec"
    pkg.mkdir()
    (pkg / "planted.py").write_text('"""x.is_cuda in a docstring is no dispatch."""\n'
                                    "# nor is x.is_cuda in a comment\n"
                                    "def f(x):\n    return g(x) if x.is_cuda else h(x)\n")
    (pkg / "kernels.py").write_text("ON = x.is_cuda\n")                   # allow-listed
    assert is_cuda_dispatches(pkg) == ["flashspec/planted.py:4: return g(x) if x.is_cuda else h(x)"]


def test_registry_imports_only_the_core_types_and_options():
    tree = ast.parse((ROOT / "flashspec" / "kernels.py").read_text())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {m for m in mods if m.startswith("flashspec")} <= {
        "flashspec.core", "flashspec.options", "flashspec.errors"}, mods
