"""The core's import graph: the modules of kvstate/ (kvstate/*.py) import one another without
a circle, and never what sits above them (mlx_lm, mlx_vlm, kvstate.adapters,
kvstate.speculative): the arrows point one way, down (DESIGN.md, Layout).

An arrow is any `import` / `from ... import` between two modules, at module level, inside a
function or under `TYPE_CHECKING` (a lazy import closes a circle too). `__init__.py` is left
out: it re-exports everything, and no module imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "kvstate"
ABOVE = ("mlx_lm", "mlx_vlm", "kvstate.adapters", "kvstate.speculative")


def imported(path: Path, package: str) -> set[str]:
    """Every module name `path` (a module of `package`) imports, relative ones resolved; for
    `from X import a, b` both `X` and `X.a`, `X.b` (a name there may be a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(folder: Path, package: str) -> dict[str, set[str]]:
    """module -> the sibling modules it imports, for the `*.py` files directly in `folder`
    (the modules of `package`), `__init__.py` left out."""
    modules = {p.stem: p for p in folder.glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name, path in modules.items():
        found = imported(path, package)
        graph[name] = {m for m in modules if m != name and f"{package}.{m}" in found}
    return graph


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (its modules in order, the first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_core_has_no_import_circle():
    graph = import_graph(CORE, "kvstate")
    assert {"kinds", "_repr", "_tree", "_transforms"} <= set(graph)
    assert "_tree" in graph["kinds"]  # the graph sees relative imports
    found = circle(graph)
    assert found is None, f"import circle in kvstate/: {' -> '.join(found)}"


def test_the_core_never_imports_the_floors_above_it():
    for path in sorted(CORE.glob("*.py")):
        found = imported(path, "kvstate")
        bad = sorted(n for n in found if any(n == a or n.startswith(f"{a}.") for a in ABOVE))
        assert not bad, f"kvstate/{path.name} imports {bad}"


def test_the_graph_finds_a_circle_and_an_import_from_above(tmp_path):
    """The checks above can fail: a two-module circle through a lazy import, and a module
    that imports mlx_lm inside a function, are both found."""
    (tmp_path / "a.py").write_text("from .b import f\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import g\n    import mlx_lm.models\n")
    (tmp_path / "c.py").write_text("from . import a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert circle(graph) == ["a", "b", "a"]
    assert "mlx_lm.models" in imported(tmp_path / "b.py", "pkg")
    assert circle({"a": {"b"}, "b": set()}) is None
