"""The flashspec package's import graph: no cycles, no imports of experiments/ or scripts/, and
layers (:data:`LAYERS`: core types, utilities, kernels and verify, models, drafters and heads,
the decode core, training, experiments) that imports only go down, verify standing on the core
types alone and models importing nothing about trees.

Every module's source is parsed (nothing is imported); ``import flashspec.x`` and
``from flashspec.x import y`` count wherever they stand, inside functions too. ``from pkg import
name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``. The parent packages
that Python initialises before a submodule are not edges (a module importing a sibling does
not depend on its package's ``__init__``), but importing a name from a package ``__init__`` is.
"""
from __future__ import annotations

import ast
import sys
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


# ----------------------------------------------------------------------------- layering
# The house, bottom up: an import may point down or sideways (within a layer), never up. A
# module belongs to the first layer with a prefix that names it or a package above it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core types", ("flashspec.core", "flashspec.errors")),
    # flashspec.kernels (the torch/Triton registry) reaches its forms by "module:attribute"
    # name, as verify.backends its backends, so it sits below every layer that holds one
    ("utilities", ("flashspec.options", "flashspec.kernels", "flashspec.paths", "flashspec.seeds",
                   "flashspec.theory", "flashspec.metrics", "flashspec.inputs", "flashspec.data",
                   "flashspec.records", "flashspec.hardware", "flashspec.runtime")),
    ("kernels and verify", ("flashspec.verify", "flashspec.tree", "flashspec.tree_kernels",
                            "flashspec.matmul")),
    ("models", ("flashspec.models",)),
    ("drafters and heads", ("flashspec.drafters", "flashspec.heads")),
    ("decode core", ("flashspec.engine", "flashspec.stepper", "flashspec.resident",
                     "flashspec.graphs", "flashspec.planner", "flashspec.bandits")),
    ("training", ("flashspec.training",)),
    ("experiments", ("flashspec.analysis",)),
]

# Upward arrows today's code still has, each with why; the test fails when one disappears too
# (then delete it here), so the list only shrinks.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}

# What "about trees" means for models/: the tree modules; of the core types, a model takes the
# attention layout of a tree step (TreeAttention) and nothing of how a tree is drafted.
TREE_MODULES = ("flashspec.tree", "flashspec.tree_kernels", "flashspec.verify.tree",
                "flashspec.verify.triton_tree")
TREE_NAMES = {"TreeDraft", "TreeShape", "MAX_NODES", "NODE_STREAMS", "pack_bits", "unpack_bits",
              "tree_mask"}


def layer_of(module: str) -> int:
    if module == "flashspec":      # the package's __init__ (empty): importing it reaches the top
        return len(LAYERS) - 1
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS; place it")


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every import ``a -> b`` of a lower layer's module ``a`` reaching up to ``b``."""
    return sorted((a, b) for a, targets in edges.items() for b in targets
                  if layer_of(b) > layer_of(a))


def core_imports() -> tuple[set[str], set[str]]:
    """(flashspec modules, other top-level packages) that flashspec.core imports."""
    return imported(PACKAGE / "core.py", "flashspec.core", set(modules()))


def names_from(path: Path, module: str) -> set[str]:
    """Names a file imports with ``from <module> import ...`` (anywhere in it)."""
    tree = ast.parse(path.read_text(), str(path))
    return {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and node.module == module and not node.level for a in node.names}


def test_every_module_has_a_layer():
    for name in modules():
        layer_of(name)


def test_layer_checker_reports_a_planted_upward_import():
    """The checker itself: verify reaching up to the tree module and a model reaching up to the
    engine inside a function (both edges as the walker records them) are reported; a
    sideways import within a layer and a downward one are not."""
    planted = {"flashspec.verify.sampling": {"flashspec.tree", "flashspec.core"},
               "flashspec.models.llama": {"flashspec.engine"},
               "flashspec.drafters.eagle": {"flashspec.heads.train", "flashspec.models.llama"}}
    assert upward(planted) == [("flashspec.models.llama", "flashspec.engine")]
    # verify -> tree is sideways by layer; the rule for verify (below) is what refuses it
    assert verify_escapes(planted) == [("flashspec.verify.sampling", "flashspec.tree")]


def test_no_import_goes_up_a_layer():
    edges, _ = graph()
    found = set(upward(edges))
    new = sorted(found - set(KNOWN_UPWARD))
    gone = sorted(set(KNOWN_UPWARD) - found)
    assert not new, "imports that go up a layer (see LAYERS):\n" + "\n".join(
        f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})" for a, b in new)
    assert not gone, f"known upward imports no longer there (delete them from KNOWN_UPWARD): {gone}"


def verify_escapes(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of flashspec.verify modules outside verify/ and below its layer: verify stands on
    the core types and utilities alone (not on flashspec.tree, the tree kernels or argmax's
    callers), so everything in its layer may use it."""
    return sorted((a, b) for a, targets in edges.items() if a.startswith("flashspec.verify")
                  for b in targets if not b.startswith("flashspec.verify")
                  and layer_of(b) >= layer_of("flashspec.verify"))


def test_verify_stands_on_the_core_types_alone():
    edges, _ = graph()
    assert not verify_escapes(edges), verify_escapes(edges)


def test_models_import_nothing_about_trees():
    edges, _ = graph()
    mods = modules()
    for name, targets in edges.items():
        if not name.startswith("flashspec.models"):
            continue
        trees = sorted(t for t in targets if t in TREE_MODULES)
        assert not trees, f"{name} imports tree modules {trees}"
        names = names_from(mods[name], "flashspec.core") & TREE_NAMES
        assert not names, f"{name} imports {sorted(names)} (a model takes TreeAttention only)"


def test_core_types_import_only_torch_the_standard_library_and_errors():
    flashspec_modules, tops = core_imports()
    assert flashspec_modules <= {"flashspec.errors"}, flashspec_modules
    other = tops - {"flashspec", "torch"} - set(sys.stdlib_module_names)
    assert not other, f"flashspec.core imports {sorted(other)}"
