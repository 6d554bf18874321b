"""docs/design.md's map of the code ("## Layers") follows the tree: every module it
names exists, and every module of the four packages is named (a folder named whole,
such as `costmodel/`, covers what is inside it). The layout's own limits too: few
modules directly in `pipeline/` and `experiments/`, the rest in folders that name
their part; no module over `MOST_LINES` lines but those `OVER_THE_LIMIT` names."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "design.md")
PACKAGES = ("storage", "tasks", "pipeline", "experiments")
AT_TOP = {"pipeline": 12, "experiments": 8}  # the most modules directly in the package
MOST_LINES = 400  # the most lines of one module
#: Modules still over `MOST_LINES`, each with why; remove an entry once it is split.
OVER_THE_LIMIT: dict[str, str] = {}


def map_entries() -> list[str]:
    """Every path the map names, relative to the root (`pipeline/cluster/links.py`,
    `pipeline/costmodel/`)."""
    text = open(PAGE, encoding="utf-8").read()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    entries, package = [], None
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or re.fullmatch(r"-+", cells[0]):
            continue
        if cells[0].strip("`") in PACKAGES:
            package = cells[0].strip("`")
        if package is None or cells[1] == "module":
            continue
        entries += [f"{package}/{name}" for name in re.findall(r"`([\w./]+)`", cells[1])]
    return entries


def package_files() -> list[str]:
    """Every Python file of the four packages, relative to the root."""
    found = []
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, package)):
            dirs[:] = [d for d in dirs if d != "__pycache__" and d != "configs"]
            found += [os.path.relpath(os.path.join(folder, name), ROOT)
                      for name in files if name.endswith(".py")]
    return sorted(found)


def tree_modules() -> list[str]:
    """The modules the map names: package files less `__init__.py` and `__main__.py`."""
    return [m for m in package_files()
            if os.path.basename(m) not in ("__init__.py", "__main__.py")]


def test_every_module_the_map_names_exists():
    missing = [entry for entry in map_entries() if not os.path.exists(os.path.join(ROOT, entry))]
    assert not missing, f"docs/design.md names what the tree lacks: {missing}"


def test_every_module_of_the_tree_is_on_the_map():
    entries = map_entries()
    folders = tuple(entry for entry in entries if entry.endswith("/"))
    unmapped = [m for m in tree_modules() if m not in entries and not m.startswith(folders)]
    assert not unmapped, f"docs/design.md's map lacks: {unmapped}"


def test_few_modules_at_the_top_of_pipeline_and_experiments():
    for package, most in AT_TOP.items():
        top = [name for name in os.listdir(os.path.join(ROOT, package))
               if name.endswith(".py") and name != "__init__.py"]
        assert len(top) <= most, f"{package}/ holds {len(top)} modules: {sorted(top)}"


def test_no_module_is_longer_than_the_limit():
    """A module that grows past the limit is split along a seam that names a job; the
    allow-list names the ones not split yet, and an entry goes once its module fits."""
    lengths = {}
    for module in package_files():
        with open(os.path.join(ROOT, module), encoding="utf-8") as f:
            lengths[module] = sum(1 for _ in f)
    over = sorted(m for m, n in lengths.items() if n > MOST_LINES and m not in OVER_THE_LIMIT)
    assert not over, f"modules over {MOST_LINES} lines: " + ", ".join(
        f"{m} ({lengths[m]})" for m in over)
    fitting = sorted(m for m in OVER_THE_LIMIT if lengths.get(m, 0) <= MOST_LINES)
    assert not fitting, f"allowed over {MOST_LINES} lines but no longer are (drop them): {fitting}"

