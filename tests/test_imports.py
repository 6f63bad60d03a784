"""The flashspec package's import graph: no cycles, no imports of experiments/ or scripts/.

Every module's source is parsed (nothing is imported); ``import flashspec.x`` and
``from flashspec.x import y`` count wherever they stand, inside functions too. ``from pkg import
name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``. The parent packages
that Python initialises before a submodule are not edges (a module importing a sibling does
not depend on its package's ``__init__``), but importing a name from a package ``__init__`` is.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flashspec"
FORBIDDEN = ("experiments", "scripts")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(path: Path, name: str, known: set[str]) -> tuple[set[str], set[str]]:
    """(flashspec modules that ``name`` imports, top-level packages it imports)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    targets: set[str] = set()
    tops: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                tops.add(alias.name.split(".")[0])
                targets.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                                   # relative import
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            tops.add(base.split(".")[0])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in known else base)
    edges = set()
    for t in targets:
        while t and t not in known:                          # `import flashspec.a.b` of a name
            t = t.rpartition(".")[0]
        if t and t != name and not name.startswith(t + "."):  # parents are not edges
            edges.add(t)
    return edges, tops


def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    mods = modules()
    known = set(mods)
    edges, tops = {}, {}
    for name, path in mods.items():
        edges[name], tops[name] = imported(path, name, known)
    return edges, tops


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as a cycle path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(_path(sorted(comp), edges))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _path(comp: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One cycle through the component's first module: a -> ... -> a."""
    members, start = set(comp), comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start] + path[::-1][1:] + [start] if v != start else [start, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def test_graph_sees_known_edges():
    """The walker itself: a module-level, a function-level and a from-package import."""
    edges, _ = graph()
    assert "flashspec.verify.reference" in edges["flashspec.verify.triton_backend"]
    assert "flashspec.models.fused" in edges["flashspec.drafters.eagle"]  # inside a function
    assert "flashspec.verify" in edges["flashspec.engine"]               # from package __init__
    assert "flashspec.verify.rng" in edges["flashspec.verify.reference"]  # from pkg import module


def test_cycle_finder_reports_a_planted_cycle():
    found = cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert found == [["a", "b", "c", "a"]]


def test_no_import_cycles():
    edges, _ = graph()
    found = cycles(edges)
    assert not found, "import cycles in flashspec:\n" + "\n".join(" -> ".join(c) for c in found)


def test_flashspec_never_imports_experiments_or_scripts():
    _, tops = graph()
    bad = {m: sorted(t & set(FORBIDDEN)) for m, t in tops.items() if t & set(FORBIDDEN)}
    assert not bad, f"flashspec modules import runner code: {bad}"
