"""Imports point one way, experiments -> pipeline -> tasks -> storage, without circles.

Read from the source (no imports run): every module's imports of the project's own
packages, at module level or inside functions alike.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ["storage", "tasks", "pipeline", "experiments"]  # each may import only leftwards


def _modules() -> dict[str, str]:
    found = {}
    for package in LAYERS:
        for folder, _dirs, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    found[module.removesuffix(".__init__")] = path
    return found


def _imports(path: str, modules: dict[str, str]) -> set[str]:
    """The project modules a file imports (``from a.b import c`` counts a.b.c if that
    is a module, else a.b)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
                     else node.module for alias in node.names]
        else:
            continue
        out.update(name for name in names if name.split(".")[0] in LAYERS)
    return out


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
