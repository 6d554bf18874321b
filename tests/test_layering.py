"""Imports point one way, experiments -> pipeline -> tasks -> storage, without circles.

Read from the source (no imports run): every module's imports of the project's own
packages, absolute or relative, at module level, inside functions or under
`if TYPE_CHECKING:` alike (a circle only type checkers follow is still a circle in
the design).
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ["storage", "tasks", "pipeline", "experiments"]  # each may import only leftwards


def _modules() -> dict[str, str]:
    """Every module of the layers by dotted name (a package by its own name), with its
    file."""
    found = {}
    for package in LAYERS:
        for folder, _dirs, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    found[module.removesuffix(".__init__")] = path
    return found


def absolute_module(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The dotted name a ``from`` import of `module` refers to: ``from ..a import b``
    (level 2, name "a") in pipeline.costmodel.kernel is pipeline.a."""
    if level == 0:
        return name or ""
    package = module if is_package else module.rpartition(".")[0]
    base = package.split(".")[:len(package.split(".")) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(path: str, modules: dict[str, str]) -> set[str]:
    """The project modules a file imports (``from a.b import c`` counts a.b.c if that
    is a module, else a.b; relative imports resolved against the file's package)."""
    module = next(m for m, p in modules.items() if p == path)
    is_package = path.endswith("__init__.py")
    tree = ast.parse(open(path, encoding="utf-8").read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = absolute_module(module, is_package, node.level, node.module)
            names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules
                     else source for alias in node.names]
        else:
            continue
        out.update(name for name in names if name.split(".")[0] in LAYERS)
    return out


def test_relative_imports_resolve_as_python_resolves_them():
    assert absolute_module("pipeline.costmodel.kernel", False, 1, "kernel_fast") == \
        "pipeline.costmodel.kernel_fast"
    assert absolute_module("pipeline.costmodel", True, 1, "devices") == \
        "pipeline.costmodel.devices"
    assert absolute_module("pipeline.costmodel.kernel", False, 2, "prediction") == \
        "pipeline.prediction"
    assert absolute_module("pipeline.costmodel.kernel", False, 1, None) == "pipeline.costmodel"
    modules = _modules()
    found = _imports(modules["pipeline.costmodel.kernel"], modules)
    assert "pipeline.costmodel.kernel_fast" in found and "pipeline.costmodel.timeline" in found


def test_imports_point_down_the_layers():
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        mine = LAYERS.index(module.split(".")[0])
        for imported in _imports(path, modules):
            if LAYERS.index(imported.split(".")[0]) > mine:
                wrong.append(f"{module} imports {imported}")
    assert not wrong, wrong


def test_no_import_circles():
    modules = _modules()
    graph = {m: {i for i in _imports(p, modules) if i in modules and i != m}
             for m, p in modules.items()}
    # a package's __init__ re-exporting its own modules is not a circle of layering
    for module in graph:
        graph[module] = {i for i in graph[module] if not module.startswith(i + ".")}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycle = trail[trail.index(nxt):] + [nxt] if nxt in trail else [node, nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
