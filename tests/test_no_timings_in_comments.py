"""Comments and docstrings in flashspec/ say why, never how fast on which machine.

A timing in a comment goes stale with the next kernel or machine and cannot be regenerated;
measurements belong in committed records and RESULTS.md (scripts/results_page.py).
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a number with a time unit, a speed, or a speed-up factor
TIMING = re.compile(r"\d(?:[\d,]*\.?\d*)?\s?(?:µs|us|ms|ns|s|sec|seconds|min|minutes|tok/s)\b"
                    r"|\d(?:\.\d+)?(?:\s?×|x(?!\w))(?!\s?[\d(])")


def _texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a source file."""
    src = path.read_text()
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(src).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                line = node.body[0].lineno
                out += [(line + i, text) for i, text in enumerate(doc.splitlines())]
    return out


def timings(path: Path) -> list[str]:
    """`file:line: text` of each comment or docstring line of ``path`` that quotes a timing."""
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return [f"{name}:{line}: {text.strip()}" for line, text in _texts(path) if TIMING.search(text)]


def test_no_comment_quotes_a_timing():
    found = [hit for path in sorted((ROOT / "flashspec").rglob("*.py")) for hit in timings(path)]
    assert not found, "timings in comments (move them to a record and RESULTS.md):\n" + "\n".join(found)


def test_the_check_sees_a_timing(tmp_path):
    """Planted timings are found; shapes (``4x2x1``, ``k x 1``) and counts are not timings."""
    planted = tmp_path / "planted.py"
    planted.write_text('"""Fast: 44.7 vs 52.0 us on one GPU."""\nX = 1  # 1.3x the chain\n'
                       'Y = 2  # 4 rows, a 4x2x1 tree, k x 1 x 1\nZ = 3  # 13 ms a prefill\n')
    assert sorted(int(h.split(":")[1]) for h in timings(planted)) == [1, 2, 4]
