"""Every Triton kernel compiles for a GPU, checked without one.

The other tests run the kernels under Triton's interpreter, which accepts code the compiler
refuses: a module global that is not a constexpr, a name bound in both branches of an ``if``
with tiles of different shapes. Both reached an H200 before (each cost a device session).
Here tests/compile_for_gpu.py imports flashspec without the interpreter and compiles every
kernel, as its host wrapper specialises it, for sm_90 (Triton's own compiler and ptxas).
"""
from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import flashspec

ROOT = Path(__file__).resolve().parents[1]


def launched_kernels() -> set[str]:
    """Names of the top-level kernels (``*_kernel``) of every flashspec module."""
    names = set()
    for info in pkgutil.walk_packages(flashspec.__path__, "flashspec."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if name.endswith("_kernel") and type(obj).__name__ in ("JITFunction",
                                                                    "InterpretedFunction"):
                names.add(name)
    return names


@pytest.fixture(scope="module")
def compiled() -> dict[str, int]:
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "compile_for_gpu.py")],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_every_kernel_compiles_for_sm90(compiled) -> None:
    missing = launched_kernels() - set(compiled)
    assert not missing, f"kernels the compile check never launched: {sorted(missing)}"
    assert all(n >= 1 for n in compiled.values())


def test_the_compile_check_catches_a_non_constexpr_global(tmp_path) -> None:
    """Power: a kernel reading a plain module global passes the interpreter but not here."""
    script = tmp_path / "bad.py"
    script.write_text(
        "import runpy, sys, torch, triton, triton.language as tl\n"
        f"sys.argv = ['x']; ns = runpy.run_path({str(ROOT / 'tests' / 'compile_for_gpu.py')!r})\n"
        "WIDTH = 4\n"
        "@triton.jit\n"
        "def bad_kernel(x_ptr):\n"
        "    tl.store(x_ptr + tl.arange(0, 4), tl.zeros([4], tl.float32) + WIDTH)\n"
        "bad_kernel[(1,)](torch.zeros(4))\n")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=900)
    assert run.returncode != 0 and "global variable WIDTH" in run.stderr, run.stderr[-2000:]
