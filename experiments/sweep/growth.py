"""Whether a store's sweep grows into this one, and where each old point lands.

A sweep whose config differs from its store's only by more ``repeats`` and values
added to axes it already has (every old value still there, in any position; a zip
group's rows likewise) can keep every finished point: `plan_growth` says so with a
`Growth` (the old cell -> new cell map, and what was added), or returns the first
difference that is not growth, as `first_difference` names it, with the growth
undone so that the line names what blocks it (``axes.train.batch: [8, 16] there,
[8] here``), not the repeats that would have been fine.

Why pure, on the two configs' YAML: the store keeps its sweep's resolved config
(`Sweep.text`), and comparing text with text is what the refusal already does; the
store's files are copied by :mod:`experiments.sweep.store_growth`.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import yaml

from experiments.sweep.axes import Axis, build_axes
from experiments.sweep.config import sweep_identity
from experiments.sweep.store_layout import (UNREADABLE_CONFIG, first_difference, flow_yaml,
                                           read_both)
from pipeline.config.schema import ConfigError

@dataclass(frozen=True)
class Growth:
    """How a store's grid grows into this sweep's: per dim (the axes, then
    ``repeat``), the new position of each old one; and each change, as a line
    names it (``repeats: 1 there, 2 here``)."""

    moves: tuple[tuple[int, ...], ...]
    new_shape: tuple[int, ...]
    changes: tuple[str, ...]

    @property
    def old_shape(self) -> tuple[int, ...]:
        return tuple(len(move) for move in self.moves)

    @property
    def old_points(self) -> int:
        return math.prod(self.old_shape)

    @property
    def new_points(self) -> int:
        """Points the grown grid has that the store's has not."""
        return math.prod(self.new_shape) - self.old_points

    def new_region(self, region: tuple[int, ...]) -> tuple[int, ...]:
        """An old point's cell in the grown grid."""
        return tuple(move[index] for move, index in zip(self.moves, region))

    def old_regions(self) -> list[tuple[int, ...]]:
        """Every cell of the store's grid."""
        return list(itertools.product(*(range(n) for n in self.old_shape)))

    def describe(self) -> str:
        """``4 new point(s) (2 -> 6: repeats: 1 there, 2 here; ...)``."""
        return (f"{self.new_points} new point(s) ({self.old_points} -> "
                f"{self.old_points + self.new_points}: {'; '.join(self.changes)})")


def _canonical(row: Any) -> str:
    return json.dumps(row, sort_keys=True, default=str)


def _axis_parts(entry: Any) -> tuple[Any, list[Any]]:
    """An ``axes:`` entry's (dim, values): a list, or ``{dim: NAME, values: [...]}``."""
    if isinstance(entry, dict):
        return entry.get("dim"), list(entry.get("values") or [])
    return None, list(entry) if isinstance(entry, list) else [entry]


def _zip_parts(group: Any) -> tuple[Any, dict[str, list[Any]]]:
    """A ``zip:`` group's (dim, {field: values})."""
    if not isinstance(group, dict):
        return None, {}
    if set(group) in ({"dim", "fields"}, {"fields"}) and isinstance(group["fields"], dict):
        return group.get("dim"), group["fields"]
    return None, group


def _zip_rows(fields: dict[str, list[Any]]) -> list[Any]:
    columns = [list(v) if isinstance(v, list) else [v] for v in fields.values()]
    return [list(row) for row in zip(*columns)]


def _grows(old: list[Any], new: list[Any]) -> bool:
    """Whether every old value (row) is among the new ones."""
    present = {_canonical(row) for row in new}
    return all(_canonical(row) in present for row in old)


def _undo_growth(there: dict, here: dict) -> tuple[dict, list[str]]:
    """`here` with each growth from `there` undone (more repeats, values added to an
    axis or a zip group of the same dim and fields), and the changes undone."""
    undone = copy.deepcopy(here)
    changes: list[str] = []
    old_repeats, new_repeats = there.get("repeats"), here.get("repeats")
    if isinstance(old_repeats, int) and isinstance(new_repeats, int) and \
            new_repeats > old_repeats:
        undone["repeats"] = old_repeats
        changes.append(f"repeats: {old_repeats} there, {new_repeats} here")
    old_axes = there.get("axes") if isinstance(there.get("axes"), dict) else {}
    for name, entry in (here.get("axes") or {}).items():
        if name not in old_axes:
            continue
        (old_dim, old_values), (new_dim, new_values) = (_axis_parts(old_axes[name]),
                                                        _axis_parts(entry))
        if old_dim == new_dim and old_values != new_values and _grows(old_values, new_values):
            undone["axes"][name] = copy.deepcopy(old_axes[name])
            changes.append(f"axes.{name}: {flow_yaml(old_values)} there, "
                           f"{flow_yaml(new_values)} here")
    old_groups = there.get("zip") if isinstance(there.get("zip"), list) else []
    for index, group in enumerate(here.get("zip") or []):
        new_dim, new_fields = _zip_parts(group)
        for old_group in old_groups:
            old_dim, old_fields = _zip_parts(old_group)
            if old_dim == new_dim and list(old_fields) == list(new_fields) and \
                    old_fields != new_fields and \
                    _grows(_zip_rows(old_fields), _zip_rows(new_fields)):
                undone["zip"][index] = copy.deepcopy(old_group)
                changes.append(f"zip.{index}: {flow_yaml(old_fields)} there, "
                               f"{flow_yaml(new_fields)} here")
    return undone, changes


def _axes_of(config: dict) -> list[Axis]:
    """The grid's axes of a resolved sweep config (measured or scaling)."""
    return build_axes(SimpleNamespace(axes=config.get("axes") or {},
                                      zip=config.get("zip") or [],
                                      measure=config.get("measure")))


def plan_growth(stored: str, current: str) -> Growth | str:
    """How the store's sweep (`stored`, the YAML it keeps) grows into this one
    (`current`): a `Growth`, or the first difference that is not growth, in
    `first_difference`'s words (the same sweep, or a mere reordering of values, is
    no growth either: nothing would be added)."""
    both = read_both(stored, current)
    if both is None:
        return UNREADABLE_CONFIG
    there, here = both
    undone, changes = _undo_growth(there, here)
    if _canonical(sweep_identity(undone)) != _canonical(sweep_identity(there)):
        return first_difference(yaml.safe_dump(sweep_identity(there), sort_keys=False),
                                yaml.safe_dump(sweep_identity(undone), sort_keys=False))
    try:
        old_axes, new_axes = _axes_of(there), _axes_of(here)
    except ConfigError as error:  # the store's own config no longer parses
        return f"the store's axes cannot be read ({error})"
    old_order = [(a.dim, a.fields) for a in old_axes]
    if old_order != [(a.dim, a.fields) for a in new_axes]:
        return (f"the axes' order: {', '.join(d for d, _ in old_order)} there, "
                f"{', '.join(a.dim for a in new_axes)} here")
    moves = []
    for old, new in zip(old_axes, new_axes):
        positions = {_canonical(list(row)): i for i, row in enumerate(new.values)}
        moves.append(tuple(positions[_canonical(list(row))] for row in old.values))
    repeats = int(there.get("repeats") or 1), int(here.get("repeats") or 1)
    moves.append(tuple(range(repeats[0])))
    growth = Growth(tuple(moves), (*(len(a) for a in new_axes), repeats[1]), tuple(changes))
    if growth.new_points <= 0:
        return first_difference(stored, current)
    return growth


def refusal(path: str, plan: Growth | str, extend: bool) -> str:
    """The one line refusing the store at `path` for this sweep: one it would grow
    (without ``--extend``), or another sweep's (naming the first difference that is
    not growth; with ``--extend``, saying what it may add)."""
    if isinstance(plan, Growth):
        return (f"{path} holds this sweep with fewer points: it would add "
                f"{plan.describe()}; pass --extend to add them, keeping every finished "
                "point (or --fresh to start over, --out for a new store)")
    only = (" (--extend adds only repeats and values of the axes the store has)"
            if extend else "")
    return (f"{path} holds a different sweep (first difference: {plan}){only}; pass "
            "--fresh to start over or --out for a new store")
