"""The configuration reference, generated from the config dataclasses themselves.

Every field of a config dataclass carries its meaning (`pipeline.config.schema.described`);
from the dataclass, its type hints, defaults and those meanings this module makes
two things: a JSON Schema (draft-07, which YAML editors read through a first line
``# yaml-language-server: $schema=...`` to complete and check a config) and the rows
of docs/configuration.md (every field by dotted name, with its type, default and
meaning). One source, so the reference cannot drift from what the loader accepts;
`experiments.sweep.reference` writes the files and a test fails when one is stale.

The JSON Schema describes shapes (keys, types, choices); ranges and the rules
between fields stay in the dataclasses' ``__post_init__``, which the loader runs.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

import yaml

from pipeline.config.schema import to_dict

JSON_SCHEMA_DRAFT = "http://json-schema.org/draft-07/schema#"
#: The first line of a config file that points YAML editors at its schema.
SCHEMA_LINE = "# yaml-language-server: $schema="


def field_doc(field: dataclasses.Field) -> str:
    """A field's meaning, as `described` recorded it ('' when it has none)."""
    return field.metadata.get("doc", "")


def _options(tp: Any) -> tuple[Any, ...]:
    return typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)


# JSON Schema ----------------------------------------------------------------------------


def definition_name(cls: type) -> str:
    """A dataclass's key among a schema's definitions: module and name, as two configs
    may hold classes of one name (the cluster's `LinkConfig`, a scaling point's)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def type_schema(tp: Any, definitions: dict[str, Any]) -> dict[str, Any]:
    """The JSON Schema of a type hint; a dataclass goes into `definitions` once, by name."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return {}
    if origin in (Union, types.UnionType):
        return {"anyOf": [type_schema(option, definitions) for option in typing.get_args(tp)]}
    if origin is Literal:
        return {"enum": list(typing.get_args(tp))}
    simple = {bool: "boolean", int: "integer", float: "number", str: "string",
              type(None): "null"}
    if tp in simple:
        return {"type": simple[tp]}
    if origin in (list, tuple):
        return {"type": "array", "items": type_schema(typing.get_args(tp)[0], definitions)}
    if origin is dict:
        return {"type": "object",
                "additionalProperties": type_schema(typing.get_args(tp)[1], definitions)}
    if dataclasses.is_dataclass(tp):
        name = definition_name(tp)
        if name not in definitions:
            definitions[name] = {}  # placeholder: a dataclass may refer to itself
            definitions[name] = dataclass_schema(tp, definitions)
        return {"$ref": f"#/definitions/{name}"}
    raise TypeError(f"schema type {tp!r} has no JSON Schema here")


def _default(field: dataclasses.Field) -> Any:
    """The field's default as plain data, or `dataclasses.MISSING` (required)."""
    if field.default is not dataclasses.MISSING:
        return to_dict(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return to_dict(field.default_factory())
    return dataclasses.MISSING


def dataclass_schema(cls: type, definitions: dict[str, Any]) -> dict[str, Any]:
    """A config dataclass as a closed JSON object: its fields' types, defaults and
    meanings; the fields without a default are required."""
    hints = typing.get_type_hints(cls)
    properties, required = {}, []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        schema = dict(type_schema(field.metadata.get("content", hints[field.name]),
                                  definitions))
        if field_doc(field):
            schema["description"] = field_doc(field)
        default = _default(field)
        if default is dataclasses.MISSING:
            required.append(field.name)
        elif not dataclasses.is_dataclass(hints[field.name]):
            schema["default"] = default
        properties[field.name] = schema
    schema = {"type": "object", "properties": properties, "additionalProperties": False}
    if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):
        schema["description"] = " ".join(cls.__doc__.split())
    if required:
        schema["required"] = required
    return schema


def json_schema(cls: type, title: str, **extra: Any) -> dict[str, Any]:
    """The whole JSON Schema document of config files read as `cls`."""
    definitions: dict[str, Any] = {}
    root = type_schema(cls, definitions)
    return {"$schema": JSON_SCHEMA_DRAFT, "title": title, **root, **extra,
            "definitions": dict(sorted(definitions.items()))}


def schema_text(schema: dict[str, Any]) -> str:
    """A schema as the file holds it (stable: regenerating changes nothing)."""
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


# The reference table -------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One field of the reference: dotted name, type, default and meaning."""

    name: str
    type: str
    default: str
    meaning: str


def type_text(tp: Any) -> str:
    """A type hint as the reference writes it (`integer`, `list of WorkerConfig`, ...)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return "any"
    if origin in (Union, types.UnionType):
        return " or ".join(type_text(option) for option in typing.get_args(tp))
    if origin is Literal:
        return " or ".join(json.dumps(value) for value in typing.get_args(tp))
    names = {bool: "boolean", int: "integer", float: "number", str: "string",
             type(None): "null"}
    if tp in names:
        return names[tp]
    if origin in (list, tuple):
        return f"list of {type_text(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"mapping to {type_text(typing.get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return str(tp)


def default_text(field: dataclasses.Field, tp: Any) -> str:
    """The default as YAML would write it; '' for a nested section, 'required' without one."""
    default = _default(field)
    if default is dataclasses.MISSING:
        return "required"
    if dataclasses.is_dataclass(tp):
        return ""
    return yaml.safe_dump(default, default_flow_style=True, sort_keys=False,
                          width=10_000).strip().removesuffix("...").strip()


def _nested(tp: Any) -> list[tuple[str, type]]:
    """The dataclasses a field's type holds, with the dotted step into each: a section
    (``''``), a list's items (``N``) or a mapping's values (``KEY``)."""
    found = []
    for option in _options(tp):
        origin = typing.get_origin(option)
        if dataclasses.is_dataclass(option):
            found.append(("", option))
        elif origin in (list, tuple) and dataclasses.is_dataclass(typing.get_args(option)[0]):
            found.append(("N.", typing.get_args(option)[0]))
        elif origin is dict and dataclasses.is_dataclass(typing.get_args(option)[1]):
            found.append(("KEY.", typing.get_args(option)[1]))
    return found


def rows(cls: type, prefix: str = "") -> list[Row]:
    """Every field of `cls` and of the dataclasses inside it, depth first, by dotted
    name (``cluster.workers.N.speed``: N is a list's index, KEY a mapping's key)."""
    hints = typing.get_type_hints(cls)
    found = []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        tp = field.metadata.get("content", hints[field.name])
        name = prefix + field.name
        found.append(Row(name, type_text(tp), default_text(field, tp), field_doc(field)))
        if "content" not in field.metadata:  # checked later as a whole: its own table
            for step, inner in _nested(tp):
                found.extend(rows(inner, f"{name}.{step}"))
    return found


def undocumented(cls: type) -> list[str]:
    """The dotted names of fields without a meaning (the reference needs one each)."""
    return [row.name for row in rows(cls) if not row.meaning.strip()]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(found: list[Row]) -> str:
    """The rows as a Markdown table (a name and a default in code spans)."""
    lines = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for row in found:
        default = f"`{row.default}`" if row.default and row.default != "required" else row.default
        lines.append(f"| `{row.name}` | {_cell(row.type)} | {_cell(default)} | "
                     f"{_cell(row.meaning)} |")
    return "\n".join(lines)


def replace_generated(text: str, section: str, body: str) -> str:
    """`text` with what stands between the markers of `section` replaced by `body`.

    Why markers: the page's prose (how values are read, what errors look like) is
    written by hand around the generated tables, in the same file.
    """
    begin, end = f"<!-- generated: {section} -->", f"<!-- end generated: {section} -->"
    if begin not in text or end not in text:
        raise ValueError(f"no {begin} ... {end} markers in the page")
    head, rest = text.split(begin, 1)
    return f"{head}{begin}\n{body}\n{end}{rest.split(end, 1)[1]}"
