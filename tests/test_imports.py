"""No import circle inside seqpar/: every import statement (at module level and inside functions)
becomes an edge of a graph of seqpar's modules, and the graph must have no cycle.

A node is one file; a package's node is its ``__init__.py``. An edge goes to the module a
statement names: ``import a.b`` -> ``a.b``; ``from a import b`` -> ``a.b`` where ``b`` is a
submodule of ``a``, else ``a``; relative imports are resolved against the importing file. The
parent packages Python initialises before a submodule are not edges: an ``__init__`` that
re-exports its submodules would otherwise be a circle with each of them, and no code writes those
imports. Everything outside seqpar (torch, transformers, ...) is ignored.
"""
from __future__ import annotations

import ast
from pathlib import Path

import seqpar

ROOT = Path(seqpar.__file__).parent


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the package directory ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _targets(node: ast.AST, name: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """The seqpar modules one import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    package = name if is_package else name.rpartition(".")[0]
    if node.level:
        base = package.split(".")
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        out.append(sub if sub in modules else source)
    return [t for t in out if t in modules]


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the seqpar modules it imports anywhere in its file (functions included)."""
    modules = module_names(root)
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[name] = {t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                       for t in _targets(node, name, is_package, modules) if t != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each strongly connected component with more than one
    module (Tarjan's algorithm, then a path around the component)."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, comp) for comp in comps]


def _cycle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A cycle through the smallest name of a strongly connected component (breadth-first)."""
    start = min(comp)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(comp)}")


def test_seqpar_has_no_import_cycle():
    graph = import_graph(ROOT)
    assert "seqpar.model.gpt" in graph and "seqpar.recompute" in graph["seqpar.model.gpt"]  # the graph is real
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in seqpar/:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_cycles_through_relative_and_function_level_imports_are_found(tmp_path):
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "from .a import f\nfrom . import sub\n",      # re-exports: not circles
        "pkg/a.py": "from .sub import b\ndef f():\n    return 1\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "import os\ndef g():\n    from ..a import f\n    return f\n",  # function-level, up two
        "pkg/c.py": "from pkg import d\n",                                # absolute, `d` is a submodule
        "pkg/d.py": "from . import f\n",                                  # `f` is no submodule: the __init__
    })
    graph = import_graph(pkg)
    assert graph["pkg"] == {"pkg.a", "pkg.sub"}
    assert graph["pkg.sub.b"] == {"pkg.a"} and graph["pkg.c"] == {"pkg.d"} and graph["pkg.d"] == {"pkg"}
    assert find_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.a"]]
    assert find_cycles({"x": {"y"}, "y": {"x"}, "z": set()}) == [["x", "y", "x"]]


# ------------------------------------------------------------------------------ package layering
# seqpar's packages (and top-level modules), lowest first: each may import only those before it.
# The README's layout section states the same order (checked below).
LAYERS = ("errors", "distributed", "sharding", "layers", "recompute", "model", "config", "flops", "memory", "parallel",
          "checkpoint", "data", "dropin", "parallelize", "plans", "plan", "train", "interop", "tools", "verify", "cli",
          "seqpar")
README = ROOT.parent / "README.md"


def layer_of(module: str) -> str:
    """``seqpar.memory.ledger`` -> ``memory``; ``seqpar.flops`` -> ``flops``; ``seqpar`` -> ``seqpar``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layering_violations(graph: dict[str, set[str]], order: tuple[str, ...]) -> list[str]:
    """``a -> b`` for every import from a module to one in the same or a higher layer than its own
    (same-layer imports are fine), plus the modules whose layer the order does not name."""
    rank = {name: i for i, name in enumerate(order)}
    out = [f"{m}: layer {layer_of(m)!r} is not in the declared order" for m in graph if layer_of(m) not in rank]
    for a, targets in graph.items():
        for b in targets:
            la, lb = layer_of(a), layer_of(b)
            if la in rank and lb in rank and rank[lb] > rank[la]:
                out.append(f"{a} ({la}) -> {b} ({lb})")
    return sorted(out)


def package_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    packages: dict[str, set[str]] = {}
    for a, targets in graph.items():
        packages.setdefault(layer_of(a), set()).update(layer_of(b) for b in targets if layer_of(b) != layer_of(a))
    for targets in list(packages.values()):
        for b in targets:
            packages.setdefault(b, set())
    return find_cycles(packages)


def test_seqpar_packages_have_no_cycle_and_follow_the_declared_order():
    graph = import_graph(ROOT)
    assert package_cycles(graph) == [], package_cycles(graph)
    bad = layering_violations(graph, LAYERS)
    assert not bad, "imports against the declared package order (README, Layout):\n" + "\n".join(bad)


def test_the_readme_declares_the_same_order():
    lines = [ln for ln in README.read_text().splitlines() if ln.startswith("Packages, lowest first:")]
    assert len(lines) == 1, "README's layout section states the package order on one line"
    declared = tuple(x.strip(" `.") for x in lines[0].split(":", 1)[1].split("<"))
    assert declared == LAYERS, declared


def test_package_checks_catch_cycles_and_upward_imports():
    graph = {"seqpar.a.x": {"seqpar.b.y"}, "seqpar.b.y": {"seqpar.a.z"}, "seqpar.a.z": set(), "seqpar.c": {"seqpar.a.x"}}
    assert package_cycles(graph) == [["a", "b", "a"]]  # no module cycle, but a package cycle
    assert find_cycles(graph) == []
    assert layering_violations(graph, ("a", "b", "c")) == ["seqpar.a.x (a) -> seqpar.b.y (b)"]
    assert layering_violations({"seqpar.q": set()}, ("a",)) == ["seqpar.q: layer 'q' is not in the declared order"]
