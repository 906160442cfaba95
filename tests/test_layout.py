"""The layout of adapters/ (adapters/README.md): wings that import only downward, no import
circle, no module reaching into another's private names. Read from the source with `ast`, so
lazy imports (inside functions) and TYPE_CHECKING imports count like any other."""

from __future__ import annotations

import ast
from pathlib import Path

ADAPTERS = Path(__file__).resolve().parent.parent / "adapters"
PACKAGE = "kvstate.adapters"

# Each wing imports only wings on lower floors (and its own modules); wings on one floor do
# not import each other. "faces" are the public modules at the top of adapters/ (its
# __init__, vlm, tiny_models, real_models): nothing inside a wing imports them.
FLOORS = {
    "kernels": 0,
    "caches": 0,
    "instruments": 1,
    "wrapped": 2,
    "models": 3,
    "faces": 4,
}

# The modules that import mlx_vlm when they are imported (mlx-vlm objects' rooms); every
# other module may import it only inside a function, when an mlx-vlm object is met.
MLX_VLM_ROOMS = (
    "kvstate.adapters.caches.vlm",
    "kvstate.adapters.wrapped.vlm",
    "kvstate.adapters.vlm",
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ADAPTERS).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


MODULES = {module_name(p): p for p in sorted(ADAPTERS.rglob("*.py"))}


def wing(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 2 and (ADAPTERS / parts[2]).is_dir():
        return parts[2]
    return "faces"


def imports(module: str) -> list[tuple[ast.ImportFrom | ast.Import, str, list[str], bool]]:
    """(statement, adapters module imported, names taken from it, at module level) for every
    import of an adapters module in `module`."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE):
                    found.append((node, _known(alias.name), [], id(node) in top))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith(PACKAGE):
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in MODULES:  # `from . import x`: the module x
                    found.append((node, submodule, [], id(node) in top))
                else:
                    found.append((node, _known(source), [alias.name], id(node) in top))
    return found


def _known(name: str) -> str:
    assert name in MODULES, f"an import of {name}, which is not a module of adapters/"
    return name


GRAPH = {m: {target for _, target, _, _ in imports(m) if target != m} for m in MODULES}


def test_the_wings_are_the_folders_and_every_module_has_one():
    assert {wing(m) for m in MODULES} == set(FLOORS)


def test_no_import_circle():
    on_path: list[str] = []
    done: set[str] = set()
    circles = []

    def visit(m: str) -> None:
        on_path.append(m)
        for n in sorted(GRAPH[m]):
            if n in on_path:
                circles.append([*on_path[on_path.index(n) :], n])
            elif n not in done:
                visit(n)
        on_path.pop()
        done.add(m)

    for m in MODULES:
        if m not in done:
            visit(m)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_wings_import_only_downward():
    upward = [
        f"{m} ({wing(m)}) imports {n} ({wing(n)})"
        for m, targets in GRAPH.items()
        for n in targets
        if wing(n) != wing(m) and FLOORS[wing(n)] >= FLOORS[wing(m)]
    ]
    assert not upward, "imports that do not point down: " + "; ".join(sorted(upward))


def test_no_module_imports_a_private_name_of_another():
    reaches = []
    for m in MODULES:
        for node, target, names, _ in imports(m):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and target != m:
                reaches.append(f"{m}:{node.lineno} takes {private} from {target}")
        reaches += _attribute_reaches(m)
    assert not reaches, "private reaches: " + "; ".join(reaches)


def _attribute_reaches(module: str) -> list[str]:
    """`x._name` where `x` is an adapters module this module imported as a name."""
    aliases = {}
    for node, target, names, _ in imports(module):
        if not names:
            for alias in node.names:
                aliases[alias.asname or alias.name.rsplit(".", 1)[-1]] = target
    tree = ast.parse(MODULES[module].read_text())
    return [
        f"{module}:{node.lineno} reads {node.value.id}.{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in aliases
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    ]


def test_mlx_vlm_is_imported_at_module_level_only_in_its_rooms():
    found = []
    for m, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            room = any(m == r or m.startswith(r + ".") for r in MLX_VLM_ROOMS)
            if any(n.split(".")[0] == "mlx_vlm" for n in names) and not room:
                found.append(f"{m}:{node.lineno}")
    assert not found, f"mlx_vlm imported on import outside its rooms: {found}"


def test_every_package_of_adapters_is_installed():
    """pyproject lists packages by hand (adapters/ installs as kvstate.adapters through
    package-dir): a folder missing there would be left out of a wheel."""
    import tomllib

    config = tomllib.loads((ADAPTERS.parent / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    packages = {module_name(p) for p in ADAPTERS.rglob("__init__.py")}
    core = ADAPTERS.parent / "kvstate"  # and kvstate's own (kvstate.engine was left out once)
    packages |= {
        ".".join(p.parent.relative_to(core.parent).parts) for p in core.rglob("__init__.py")
    }
    assert packages <= listed, f"not in pyproject's packages: {sorted(packages - listed)}"
