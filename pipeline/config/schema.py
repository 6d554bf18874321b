"""Turn plain YAML data into typed, validated dataclasses.

Config is validated once, at the edge: every later piece of code can trust the types.
A mistake gives one `ConfigError` whose message names the offending field by its
dotted path (``train.steps: expected an integer, got 'three'``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import types
import typing
from typing import Any, Literal, Union

import yaml
from dask.utils import parse_bytes


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field."""


class FieldError(ConfigError):
    """A value out of range, raised by a config dataclass's ``__post_init__``.

    The dataclass knows only its own field names; `from_dict` prefixes the dotted
    path of the mapping it was read from, so the message names the whole path
    (``train.lr: ...``) however deep the dataclass sits.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


def described(default: Any = dataclasses.MISSING, doc: str = "", *,
              factory: Any = dataclasses.MISSING, content: Any = None) -> Any:
    """A config dataclass's field with its meaning for a user (``doc``).

    Why here: the meaning is written once, beside the field, and both the JSON
    Schema editors read and docs/configuration.md are generated from it
    (`pipeline.config.reference`), so neither can drift from the code. `content` is
    the type a raw field holds once checked later (a sweep's ``base``: a run config),
    for the schema only.
    """
    metadata = {"doc": doc} if content is None else {"doc": doc, "content": content}
    return dataclasses.field(default=default, default_factory=factory, metadata=metadata)


def check_range(obj: Any, name: str, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False) -> None:
    """Raise FieldError unless ``obj.name`` is a finite number in the given interval.

    None stands for "no value" and is left alone; NaN and infinities are rejected
    because every comparison with them is false and they would slip through.
    """
    value = getattr(obj, name)
    if value is None:
        return
    # an int is finite, and one past a float's range would overflow math.isfinite
    inside = not isinstance(value, float) or math.isfinite(value)
    if inside and low is not None:
        inside = value > low if low_open else value >= low
    if inside and high is not None:
        inside = value < high if high_open else value <= high
    if not inside:
        kind = "an integer" if isinstance(value, int) else "a number"
        raise FieldError(name, f"expected {kind} {_interval(low, high, low_open, high_open)}, "
                               f"got {_describe(value)}")


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {_bound(low)}"
    if low is None:
        return f"{'<' if high_open else '<='} {_bound(high)}"
    return (f"in {'(' if low_open else '['}{_bound(low)}, {_bound(high)}"
            f"{')' if high_open else ']'}")


def _bound(value: float) -> str:
    """An interval's end as written: an integer whole (2**64 - 1 is not 1.84467e+19)."""
    return str(value) if isinstance(value, int) else f"{value:g}"


# YAML -------------------------------------------------------------------------------

# YAML 1.2 floats that PyYAML (YAML 1.1) reads as strings: an exponent without a
# dot in the mantissa (``1e-3``) or without a sign (``1.5e3``). Ints keep their
# own resolver, which comes first, so ``10`` stays an int.
_FLOAT_12 = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading numbers as YAML 1.2 does and refusing
    duplicate keys (YAML forbids them; PyYAML would silently keep the last, so a
    second ``train:`` block would quietly undo the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _value in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # unhashable: the base class reports it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12,
                                   list("-+0123456789."))


def yaml_load(text: Any) -> Any:
    """Parse YAML text or a stream: the one reader of configs and overrides."""
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - a SafeLoader subclass


def _describe(value: Any) -> str:
    if isinstance(value, int) and value.bit_length() > 200:  # repr of one is megabytes
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is bool:
        return "true or false"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return "a list"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    return str(tp)


def convert(tp: Any, value: Any, where: str) -> Any:
    """Check `value` against the type `tp` and convert it (mappings -> dataclasses)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return convert(option, value, where)
            except ConfigError as error:
                errors.append(error)
        # One alternative matched the shape but failed deeper: report that one.
        deeper = [e for e in errors if not str(e).startswith(f"{where}: expected")]
        if deeper:
            raise deeper[0]
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {_describe(value)}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: expected {_type_name(tp)}, got {_describe(value)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {_describe(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {_describe(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {_describe(value)}")
        return value
    if origin is list or origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {_describe(value)}")
        (item_type, *_rest) = typing.get_args(tp)
        items = [convert(item_type, item, f"{where}.{i}") for i, item in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {_describe(value)}")
        key_type, value_type = typing.get_args(tp)
        return {
            convert(key_type, k, f"{where}"): convert(value_type, v, f"{where}.{k}")
            for k, v in value.items()
        }
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    raise TypeError(f"schema type {tp!r} at {where} is not supported")


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """`cls`'s field types, resolved once per class: a sweep builds thousands of
    configs, and resolving them anew each time is most of the building."""
    return typing.get_type_hints(cls)


def from_dict(cls: type, data: Any, where: str = "") -> Any:
    """Build dataclass `cls` from a mapping, rejecting unknown keys and wrong types."""
    prefix = f"{where}." if where else ""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {_describe(data)}")
    hints = _type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown key (expected one of {', '.join(sorted(known))})"
        )
    values = {}
    for name, field in known.items():
        if name in data:
            values[name] = convert(hints[name], data[name], f"{prefix}{name}")
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{prefix}{name}: required key is missing")
    try:
        return cls(**values)
    except FieldError as error:
        raise FieldError(f"{prefix}{error.field}", error.problem) from None
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{where or 'config'}: {error}") from None


def to_dict(obj: Any) -> Any:
    """The plain-data form of a config dataclass (what YAML would hold)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``a.b.c=value`` and parse the value as YAML (so ``3`` is an int)."""
    if "=" not in text:
        raise ConfigError(f"{text}: an override must look like key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"{text}: an override needs a key before '='")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def set_dotted(data: dict, dotted: str, value: Any) -> None:
    """Set ``data[a][b][0][c] = value`` for the dotted path ``a.b.0.c``.

    Missing mappings on the way are created, so an override can set a field the
    YAML left at its default; the schema then rejects keys that do not exist.
    """
    parts = dotted.split(".")
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        where = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            node = node[_list_index(node, part, where)]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"{where}: cannot set a field inside {_describe(node)}")
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        node[_list_index(node, last, dotted)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(f"{dotted}: cannot set a field inside {_describe(node)}")


def _list_index(node: list, part: str, where: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"{where}: no item {part!r} in a list of {len(node)}")
    return int(part)


#: The largest config file read: YAML parses about a megabyte a second here, and no
#: run or sweep config comes near this (a run name of megabytes once did).
CONFIG_MAX_BYTES = 1_000_000


def load_yaml(path: str) -> dict:
    """Read a YAML mapping, turning file and syntax problems into ConfigError; a file
    over `CONFIG_MAX_BYTES` is refused before it is parsed."""
    try:
        with open(path, encoding="utf-8") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > CONFIG_MAX_BYTES:
                raise ConfigError(f"{path}: {size} bytes, too large for a config (at most "
                                  f"{CONFIG_MAX_BYTES})")
            data = yaml_load(handle)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (not UTF-8), so not a config") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the config ({error.strerror})") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or ""
        detail = ": ".join(part for part in (where, problem) if part)
        raise ConfigError(f"{path}: not valid YAML" + (f" ({detail})" if detail else "")
                          ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a mapping of keys to values")
    return data


def parse_size(value: Any, name: str) -> float | None:
    """A size in bytes from ``"2GB"``, ``"1.5GiB"`` or a number (None stays None); a
    FieldError naming `name` for anything else, or for a size not above zero."""
    if value is None:
        return None
    try:
        size = (float(value) if isinstance(value, (int, float)) and not isinstance(value, bool)
                else float(parse_bytes(str(value))))
    except (ValueError, TypeError):
        size = -1.0
    if isinstance(value, bool) or not math.isfinite(size) or size <= 0:
        raise FieldError(name, "expected a size such as '2GB', '1.5GiB' or a number of bytes "
                         f"> 0, got {value!r}")
    return size
