"""The package's import graph: layers top to bottom, no import reaching up a layer, no import circles.

Layers (DESIGN.md), top first; a module may import from its own layer and the layers below:
    cli → fleet → api (compiler, report) → runtime, codegen → passes → capture → comm → ops → ir → strategy, errors
`viz` stands beside the stack: it imports from every layer below `cli`, and only `cli` (and `fleetc/__init__.py`,
which re-exports the public API and registers the notebook views) import it.

Every import counts for the layers, including imports inside functions (they still make the lower module depend
on the upper one); `if TYPE_CHECKING:` imports do not. Circles are checked over imports that run when a module is
imported; a function-local import of a sibling in the same layer (`Program.__str__` calling the printer) is how a
data class offers a convenience implemented beside it, and is allowed.
"""
from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "fleetc"

LAYERS = (  # bottom first
    ("fleetc.errors", "fleetc.strategy"),
    ("fleetc.ir",),
    ("fleetc.ops",),
    ("fleetc.comm",),
    ("fleetc.capture",),
    ("fleetc.passes",),
    ("fleetc.runtime", "fleetc.codegen"),
    ("fleetc.compiler", "fleetc.report", "fleetc.compile_cache"),
    ("fleetc.fleet",),
    ("fleetc.viz",),
    ("fleetc.cli", "fleetc.__main__"),
)
EXEMPT = {"fleetc"}  # fleetc/__init__.py: the public API


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, (ast.Name, ast.Attribute)) and ast.unparse(node.test).endswith("TYPE_CHECKING")


def _imports(path: pathlib.Path) -> list[tuple[str, bool]]:
    """(imported fleetc module, imported at module level?) for every import in the file."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, ast.ImportFrom) and child.level == 0 and (child.module or "").startswith("fleetc"):
                for alias in child.names:
                    sub = f"{child.module}.{alias.name}"
                    found.append((sub if sub in MODULES else child.module, top_level))
            elif isinstance(child, ast.Import):
                found.extend((alias.name, top_level) for alias in child.names if alias.name.startswith("fleetc"))
            nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, top_level and not nested)

    visit(ast.parse(path.read_text()), True)
    return found


def _layer(module: str) -> int:
    if module == "fleetc":  # `import fleetc` reaches the public API
        module = "fleetc.compiler"
    for index, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_no_import_reaches_up_a_layer():
    upward = []
    for module, path in sorted(MODULES.items()):
        if module in EXEMPT:
            continue
        for target, _ in _imports(path):
            if target in MODULES and _layer(target) > _layer(module):
                upward.append(f"{module} imports {target}")
    assert not upward, "imports reaching up a layer:\n" + "\n".join(upward)


def test_nothing_below_the_command_line_imports_viz():
    viz = _layer("fleetc.viz")
    offenders = [f"{module} imports {target}" for module, path in MODULES.items() if module not in EXEMPT
                 for target, _ in _imports(path)
                 if _layer(target) == viz and _layer(module) != viz and module not in LAYERS[-1]]
    assert not offenders, "\n".join(offenders)


def test_no_import_circles():
    graph = nx.DiGraph()
    for module, path in MODULES.items():
        graph.add_node(module)
        for target, top_level in _imports(path):
            if target in MODULES and target != module and (top_level or _layer(target) != _layer(module)):
                graph.add_edge(module, target)
    circles = [" -> ".join(cycle) for cycle in nx.simple_cycles(graph)]
    assert not circles, "import circles:\n" + "\n".join(circles)


@pytest.mark.parametrize("source", [
    "from fleetc.compiler import compile\n",
    "def f():\n    from fleetc.viz import report_html\n",
])
def test_the_checker_sees_upward_imports(tmp_path, source):
    """The scan itself: a module-level and a function-local import of a higher layer are both found."""
    path = tmp_path / "probe.py"
    path.write_text(source)
    targets = [target for target, _ in _imports(path)]
    assert targets and all(_layer(t) > _layer("fleetc.ir") for t in targets)


def _private_imports(path: pathlib.Path) -> list[str]:
    """`from fleetc.x import _name` in the file: a private name used outside its module."""
    return [f"from {node.module} import {alias.name}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fleetc")
            for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]


def test_no_module_imports_another_modules_private_name(tmp_path):
    """A name another module needs is public (named for what it is, with a docstring), or lives where it is used."""
    offenders = [f"{module}: {line}" for module, path in sorted(MODULES.items()) for line in _private_imports(path)]
    assert not offenders, "private names imported across modules:\n" + "\n".join(offenders)
    probe = tmp_path / "probe.py"  # the scan itself
    probe.write_text("def f():\n    from fleetc.comm.mesh import _hidden, resolve_mesh\n")
    assert _private_imports(probe) == ["from fleetc.comm.mesh import _hidden"]
