"""The configuration reference stays the code's: the JSON Schemas and
docs/configuration.md's tables match what `python -m experiments.sweep.reference
--write` makes from the config dataclasses, every field has a meaning, and every
shipped config points YAML editors at its schema. Pure: no cluster."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from experiments.sweep import reference
from pipeline.config.reference import (SCHEMA_LINE, json_schema, markdown_table,
                                       replace_generated, rows, undocumented)
from pipeline.config.schema import described

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Inner:
    rate: float = described(1.0, "how fast")
    note: str = ""  # a meaning in a comment only: the reference cannot see it


@dataclass
class Outer:
    count: int = described(doc="how many")
    parts: list[Inner] | None = described(None, "the parts")


def test_the_schemas_and_the_page_are_current():
    assert reference.stale() == [], "run python -m experiments.sweep.reference --write"


@pytest.mark.parametrize("cls", reference.DOCUMENTED, ids=lambda cls: cls.__name__)
def test_every_field_has_a_meaning(cls):
    assert undocumented(cls) == []


def test_a_field_without_a_meaning_is_named_by_its_dotted_name():
    assert undocumented(Outer) == ["parts.N.note"]
    assert reference.main([]) == 0  # the shipped classes have none


def test_rows_give_type_default_and_meaning_of_nested_fields():
    found = {row.name: row for row in rows(Outer)}
    assert found["count"].default == "required" and found["count"].meaning == "how many"
    assert found["parts"].type == "list of mapping or null"
    assert (found["parts.N.rate"].type, found["parts.N.rate"].default) == ("number", "1.0")
    assert "| `parts.N.rate` | number | `1.0` | how fast |" in markdown_table(rows(Outer))


def test_the_schema_is_closed_typed_and_carries_the_meanings():
    schema = json_schema(Outer, "outer")
    root = schema["definitions"][schema["$ref"].rsplit("/", 1)[1]]
    assert root["required"] == ["count"] and root["additionalProperties"] is False
    assert root["properties"]["count"] == {"type": "integer", "description": "how many"}
    inner = next(d for name, d in schema["definitions"].items() if name.endswith("Inner"))
    assert inner["properties"]["rate"]["default"] == 1.0


def test_a_change_to_a_generated_file_is_reported_stale(tmp_path, monkeypatch, capsys):
    """On copies of the three files: an edited schema is named, `--write` mends it."""
    for name in ("RUN_SCHEMA", "SWEEP_SCHEMA", "PAGE"):
        copy = tmp_path / getattr(reference, name).name
        copy.write_text(getattr(reference, name).read_text(encoding="utf-8"), encoding="utf-8")
        monkeypatch.setattr(reference, name, copy)
    schema = json.loads(reference.RUN_SCHEMA.read_text(encoding="utf-8"))
    schema["title"] = "edited by hand"
    reference.RUN_SCHEMA.write_text(json.dumps(schema), encoding="utf-8")
    assert reference.stale() == [reference.RUN_SCHEMA]
    assert reference.main([]) == 1
    assert "stale: " in capsys.readouterr().err
    assert reference.main(["--write"]) == 0 and reference.stale() == []


def test_generated_sections_replace_only_what_is_between_their_markers():
    page = "intro\n<!-- generated: a -->\nold\n<!-- end generated: a -->\noutro\n"
    assert replace_generated(page, "a", "new") == page.replace("old", "new")
    with pytest.raises(ValueError, match="generated: b"):
        replace_generated(page, "b", "new")


@pytest.mark.parametrize("path", sorted([*ROOT.glob("configs/*.yaml"),
                                         *ROOT.glob("experiments/configs/*.yaml")]),
                         ids=lambda path: f"{path.parent.name}/{path.name}")
def test_every_shipped_config_points_at_its_schema(path):
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith(SCHEMA_LINE), first
    target = (path.parent / first[len(SCHEMA_LINE):]).resolve()
    wanted = reference.RUN_SCHEMA if path.parent.name == "configs" and \
        path.parent.parent == ROOT else reference.SWEEP_SCHEMA
    assert target == wanted
