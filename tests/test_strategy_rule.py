"""Nothing outside a strategy asks which strategy it holds (docs/design.md, "Strategies").

An AST scan of pipeline/ and experiments/ outside pipeline/strategies/ for a branch on
a strategy: a comparison (``==``, ``!=``, ``in``, ``not in``) against a registered
strategy's name (a literal, or a module-level constant or tuple of them, imported or
not), a comparison of anything called ``strategy`` (``config.strategy``,
``frame["strategy"]``, ``base_strategy``), or ``isinstance`` on a strategy's layout
class. What a strategy does differently is an answer of its `Strategy` object
(pipeline/strategies/base.py); `ALLOWED` lists, each with why, the places where a
name is data.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Iterator

import pytest

import tasks.layout
import tasks.replica_layout
from pipeline.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("pipeline", "experiments")
#: Where strategies live: the only place that may ask which one it is.
EXEMPT = "pipeline/strategies/"
#: The classes of strategies' layouts (an isinstance on one asks which strategy).
LAYOUT_CLASSES = {name for module in (tasks.layout, tasks.replica_layout)
                  for name in vars(module) if name.endswith("Layout")}
#: The names a literal is matched against: every registered strategy's but ``auto``,
#: which is also every setting's automatic value (``steps_per_task: auto``); a
#: strategy compared with it is still found by what it compares (`says_strategy`).
NAMES = set(STRATEGIES) - {"auto"}

#: (file, the comparison as `ast.unparse` writes it) -> why the name there is data.
ALLOWED: dict[tuple[str, str], str] = {
    # A report's paper comparison: the paper measured kernel parallelism, so its figure
    # is set beside the store's rows of that strategy (a name stored in the results).
    ("experiments/report/markdown.py", "frame['strategy'] == PAPER_STRATEGY"):
        "the paper's method, as the store names its rows",
    # The paper's placement claim (calibrated against even) is about kernel parallelism.
    ("experiments/report/figures.py", "frame['strategy'] == PAPER_STRATEGY"):
        "the paper's method, as the store names its rows",
    # A legend: the scaling report marks the baseline's line (named in the sweep's attrs).
    ("experiments/scaling/speedup_figure.py", "s == BASELINE"):
        "a legend entry and line style of the scaling baseline",
    # The sweep's baseline is a name in its config (`speedup_baseline`): the speedup
    # is available where the points' strategy is that baseline.
    ("experiments/sweep/speedup.py", "base_strategy == baseline"):
        "the baseline's name in the sweep's config",
    # A report selects the store's rows by their strategy coordinate (names stored in
    # the results, whatever strategies this checkout registers).
    ("experiments/report/auto.py", "frame['strategy'] == AUTO"):
        "the store's rows of `auto` points",
    ("experiments/report/auto.py", "same['strategy'] == chosen"):
        "the store's rows of the strategy `auto` chose (a name recorded in the store)",
    ("experiments/report/figures.py", "frame['strategy'] != sweep.baseline"):
        "the store's rows other than its baseline's (named in the sweep's attrs)",
    ("experiments/report/growth.py", "frame['strategy'] == strategy"):
        "the store's rows of one strategy coordinate, one line each",
    ("experiments/scaling/regions.py", "REGION_OF not in view.labels(sdim)"):
        "the store's rows of the strategy whose winning region the scaling report tabulates",
    # Not strategies: names that happen to equal one.
    ("pipeline/records/summary.py", "unit == 'kernel'"):
        "a split's unit (`Strategy.split_unit`), worded in a left-out line",
    ("pipeline/costmodel/replicas.py", "options.timeline == 'reference'"):
        "the model's op-by-op timeline (`Options.timeline`), not a strategy",
    ("pipeline/costmodel/kernel.py", "options.timeline == 'reference'"):
        "the model's op-by-op timeline (`Options.timeline`), not a strategy",
    ("pipeline/costmodel/replicas.py", "options.timeline != 'reference'"):
        "the model's op-by-op timeline (`Options.timeline`), not a strategy",
    # The cost model's own table of step models, by its names (it may not import
    # pipeline.strategies): a lookup that refuses an unknown name.
    ("pipeline/costmodel/strategies.py", "strategy not in MODELS"):
        "the cost model's step models, a table keyed by name",
}


def python_files() -> Iterator[tuple[str, ast.Module]]:
    """Every scanned module, by its path from the root, parsed."""
    for top in SCANNED:
        for folder, _, files in os.walk(ROOT / top):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = Path(folder) / name
                    rel = path.relative_to(ROOT).as_posix()
                    yield rel, ast.parse(path.read_text(), rel)


def module_name(rel: str) -> str:
    return rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def strategy_names(node: ast.AST, constants: dict[str, set[str]]) -> set[str]:
    """The registered names `node` stands for: a literal, a tuple/list/set of them, or
    a constant (module-level or imported) holding them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(strategy_names(e, constants) for e in node.elts))
    if isinstance(node, ast.Name):
        return constants.get(node.id, set())
    return set()


def module_constants(tree: ast.Module) -> dict[str, set[str]]:
    """A module's top-level names bound to strategy names (``REFERENCE = "reference"``)."""
    found: dict[str, set[str]] = {}
    for statement in tree.body:
        targets = (statement.targets if isinstance(statement, ast.Assign) else
                   [statement.target] if isinstance(statement, ast.AnnAssign)
                   and statement.value else [])
        for target in targets:
            if isinstance(target, ast.Name):
                names = strategy_names(statement.value, {})
                if names:
                    found[target.id] = names
    return found


def says_strategy(node: ast.AST) -> bool:
    """`node` names a strategy: ``strategy``, ``x.strategy``, ``x["strategy"]``,
    ``base_strategy``."""
    if isinstance(node, ast.Name):
        return "strategy" in node.id.lower()
    if isinstance(node, ast.Attribute):
        return "strategy" in node.attr.lower()
    if isinstance(node, ast.Subscript):
        key = node.slice
        return isinstance(key, ast.Constant) and key.value == "strategy"
    return False


def branches(tree: ast.Module, constants: dict[str, set[str]]) -> Iterator[tuple[int, str]]:
    """Each comparison or isinstance in `tree` that asks which strategy it holds."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(
                isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            operands = [node.left, *node.comparators]
            if any(strategy_names(o, constants) or says_strategy(o) for o in operands):
                yield node.lineno, ast.unparse(node)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "isinstance" and len(node.args) == 2):
            classes = node.args[1]
            named = classes.elts if isinstance(classes, ast.Tuple) else [classes]
            if any(isinstance(c, ast.Name) and c.id in LAYOUT_CLASSES for c in named):
                yield node.lineno, ast.unparse(node)


def find_branches() -> list[tuple[str, int, str]]:
    """Every branch on a strategy outside pipeline/strategies/, allowed ones included."""
    modules = dict(python_files())
    by_module = {module_name(rel): module_constants(tree) for rel, tree in modules.items()}
    found = []
    for rel, tree in modules.items():
        if rel.startswith(EXEMPT):
            continue
        constants = dict(by_module[module_name(rel)])
        for statement in tree.body:  # constants imported from another scanned module
            if isinstance(statement, ast.ImportFrom) and statement.module in by_module:
                for alias in statement.names:
                    names = by_module[statement.module].get(alias.name)
                    if names:
                        constants[alias.asname or alias.name] = names
        found += [(rel, line, text) for line, text in branches(tree, constants)]
    return found


def test_no_module_outside_the_strategies_branches_on_one():
    unexplained = [f"{rel}:{line}: {text}" for rel, line, text in find_branches()
                   if (rel, text) not in ALLOWED]
    assert not unexplained, ("branches on a strategy outside pipeline/strategies/ (ask the "
                             "Strategy object instead):\n" + "\n".join(unexplained))


def test_every_allowed_branch_still_exists():
    """An allowance whose line is gone is dropped, so the list stays the data cases."""
    present = {(rel, text) for rel, _, text in find_branches()}
    assert not set(ALLOWED) - present, sorted(set(ALLOWED) - present)


@pytest.mark.parametrize("source", [
    'def f(config):\n    return config.strategy in ("single", "kernel")\n',
    'KINDS = ("data", "hybrid")\ndef f(name):\n    return name in KINDS\n',
    'def f(point):\n    if point.strategy == other:\n        pass\n',
    'def f(layout):\n    return isinstance(layout, (KernelLayout, int))\n',
])
def test_the_scan_sees_a_branch(source):
    tree = ast.parse(source)
    assert list(branches(tree, module_constants(tree)))
