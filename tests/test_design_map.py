"""docs/design.md's map of the code ("## Layers") follows the tree: every module it
names exists, and every module of the four packages is named (a folder named whole,
such as `costmodel/`, covers what is inside it). The layout's own limits too: few
modules directly in `pipeline/` and `experiments/`, the rest in folders that name
their part."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "design.md")
PACKAGES = ("storage", "tasks", "pipeline", "experiments")
AT_TOP = {"pipeline": 12, "experiments": 8}  # the most modules directly in the package


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


def tree_modules() -> list[str]:
    found = []
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, package)):
            dirs[:] = [d for d in dirs if d != "__pycache__" and d != "configs"]
            for name in files:
                if name.endswith(".py") and name not in ("__init__.py", "__main__.py"):
                    found.append(os.path.relpath(os.path.join(folder, name), ROOT))
    return sorted(found)


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
