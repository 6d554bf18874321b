"""Property-based: mutate valid configs and command lines, and check what the CLIs say.

Every mutation that makes the input wrong (a renamed, retyped or dropped required
key, a number out of range, a key written twice, an unknown option) must be refused
with exactly one line naming it and exit 2; every mutation known to keep it valid
(options in any order, numbers as ``1e-3``, an integer where a number is wanted,
keys in any order, a repeated override) must be accepted and mean the same config.

Only validation runs (`python -m pipeline.train --check`, `experiments.sweep.cli
--dry-run`, both through `main(argv)` in-process), never a training: an example
costs milliseconds. Hypothesis runs derandomized (a fixed sequence of examples),
so CI sees the same cases every time.
"""

from __future__ import annotations

import copy
import os
import string
from unittest import mock
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import train as train_cli
from pipeline.config.run_config import load_run_config
from pipeline.config.schema import to_dict, yaml_load
from tests.helpers import assert_one_error_line, run_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = os.path.join(ROOT, "configs", "small.yaml")
QUICK = os.path.join(ROOT, "experiments", "configs", "quick.yaml")
SCHEDULER = "tcp://127.0.0.1:8786"  # nothing listens: --check's question to it is stubbed

SETTINGS = dict(derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

#: Each property's example budget, by name: docs/reliability.md quotes the totals.
BUDGETS: dict[str, int] = {}


def budget(max_examples: int):
    """Hypothesis settings of a property, recorded in BUDGETS."""
    def apply(test):
        BUDGETS[test.__name__] = max_examples
        return settings(max_examples=max_examples, **SETTINGS)(test)
    return apply


FAST = budget(60)  # pipeline.train --check: ~30 ms an example
SLOW = budget(25)  # a sweep --dry-run of 10 points: ~100 ms


@pytest.fixture(scope="module", autouse=True)
def workdir(tmp_path_factory):
    """Run from a temporary folder (relative default paths land there), with the
    performance model kept from probing a cluster in dry runs."""
    folder = tmp_path_factory.mktemp("properties")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setenv("CNN_PREDICT_PROBE", "never")
        patch.setenv("CNN_PROBE_CACHE", str(folder / "probes"))
        patch.delenv("DASK_SCHEDULER_ADDRESS", raising=False)
        yield folder


def assert_refused(cli: str, argv: list[str], names: str) -> None:
    assert_one_error_line(*run_main(cli, argv)[:2], 2, names)


def assert_accepted(cli: str, argv: list[str]) -> str:
    status, lines, out = run_main(cli, argv)
    assert status == 0 and not lines, (argv, status, lines)
    return out


# Config data and where its leaves are ---------------------------------------------------

def load(path: str) -> dict:
    with open(path, encoding="utf-8") as handle:
        return yaml_load(handle)


def leaves(node: Any, path: tuple = ()) -> list[tuple]:
    """Paths (keys and list indices) to every scalar or empty container."""
    if isinstance(node, dict) and node:
        return [p for k, v in node.items() for p in leaves(v, (*path, k))]
    if isinstance(node, list) and node:
        return [p for i, v in enumerate(node) for p in leaves(v, (*path, i))]
    return [path]


def keys(node: Any, path: tuple = ()) -> list[tuple]:
    """Paths to every mapping key."""
    found = []
    if isinstance(node, dict):
        for k, v in node.items():
            found += [(*path, k), *keys(v, (*path, k))]
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += keys(v, (*path, i))
    return found


def get(data: Any, path: tuple) -> Any:
    for part in path:
        data = data[part]
    return data


def dotted(path: tuple) -> str:
    return ".".join(str(part) for part in path)


def render(value: Any) -> str:
    """A value as YAML flow text, as it would be typed in an override."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def write(data: dict, name: str = "mutated.yaml") -> str:
    path = os.path.abspath(name)
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(data, handle, sort_keys=False)
    return path


SMALL_DATA = load(SMALL)
QUICK_DATA = load(QUICK)
TRAIN_BASE = [f"output={os.path.join('runs', 'prop')}"]

# Text that YAML reads as text whatever the resolver (no digits, no yes/no words).
WORDS = st.text(string.ascii_lowercase, min_size=3, max_size=8).filter(
    lambda w: w not in ("yes", "off", "null", "true", "false", "nan", "inf"))


def wrong_values(original: Any) -> st.SearchStrategy:
    """Values of a type the field that held `original` can never take."""
    mapping = st.dictionaries(WORDS, st.integers(0, 9), min_size=1, max_size=2)
    if isinstance(original, bool):
        return st.one_of(WORDS, st.integers(2, 99))
    if isinstance(original, int):
        return st.one_of(WORDS, st.integers(0, 99).map(lambda i: i + 0.5),
                         st.lists(st.integers(0, 9), min_size=1, max_size=2), mapping)
    if isinstance(original, float):
        return st.one_of(WORDS, st.booleans(), st.lists(st.integers(0, 9), min_size=1), mapping)
    if isinstance(original, str):
        return st.one_of(st.integers(0, 99), st.lists(WORDS, min_size=1, max_size=2), mapping)
    return st.one_of(WORDS, st.integers(0, 99).map(lambda i: i + 0.5))  # lists, mappings


def under(path: tuple) -> str:
    """What the sweep's message names for a path in its file: a base field by its
    run-config name (``base.train.lr`` -> ``train.lr``), an axis value by the field
    the axis sweeps (``axes.strategy.2`` -> ``strategy``), the rest as written."""
    if path[0] == "axes" and len(path) > 1:
        return str(path[1])
    return dotted(path[1:] if path[0] == "base" and len(path) > 1 else path)


# pipeline.train: broken configs -------------------------------------------------------

@FAST
@given(st.data())
def test_a_retyped_value_is_refused_naming_it(data):
    path = data.draw(st.sampled_from(leaves(SMALL_DATA)), label="leaf")
    value = data.draw(wrong_values(get(SMALL_DATA, path)), label="value")
    if data.draw(st.booleans(), label="in the file"):
        mutated = copy.deepcopy(SMALL_DATA)
        get(mutated, path[:-1])[path[-1]] = value
        assert_refused("train", [write(mutated), *TRAIN_BASE], dotted(path))
    else:
        assert_refused("train", [SMALL, *TRAIN_BASE, f"{dotted(path)}={render(value)}"],
                       dotted(path))


@FAST
@given(st.data())
def test_a_renamed_key_is_refused_naming_it(data):
    path = data.draw(st.sampled_from(keys(SMALL_DATA)), label="key")
    suffix = data.draw(WORDS, label="suffix")
    mutated = copy.deepcopy(SMALL_DATA)
    parent = get(mutated, path[:-1])
    renamed = {(f"{k}{suffix}" if k == path[-1] else k): v for k, v in parent.items()}
    parent.clear()
    parent.update(renamed)
    assert_refused("train", [write(mutated), *TRAIN_BASE], dotted((*path[:-1], f"{path[-1]}{suffix}")))


@FAST
@given(st.data())
def test_a_dropped_key_is_refused_only_if_required(data):
    path = data.draw(st.sampled_from(keys(SMALL_DATA)), label="key")
    mutated = copy.deepcopy(SMALL_DATA)
    del get(mutated, path[:-1])[path[-1]]
    argv = [write(mutated), *TRAIN_BASE, "--check"]
    if path[-1] == "kernels":  # the only key without a default
        assert_refused("train", argv, f"{dotted(path)}: required key is missing")
    else:
        assert_accepted("train", argv)


@FAST
@given(st.sampled_from(sorted(SMALL_DATA)), st.data())
def test_a_key_written_twice_is_refused(key, data):
    text = open(SMALL, encoding="utf-8").read()
    again = render({key: SMALL_DATA[key]})[1:-1]  # "key: value" in flow style
    where = data.draw(st.sampled_from(["start", "end"]), label="where")
    path = os.path.abspath("twice.yaml")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(f"{again}\n{text}" if where == "start" else f"{text}\n{again}\n")
    assert_refused("train", [path, *TRAIN_BASE, "--check"], f"duplicate key '{key}'")


# Numbers out of range, with the interval each field accepts.
INTS_BELOW = {"train.steps": 1, "train.batch": 1, "train.inflight": 1, "train.seed": 0,
              "train.steps_per_task": 1,
              "train.warmup_steps": 0, "train.checkpoint_every": 0, "train.eval_samples": 0,
              "network.conv.0.kernels": 1, "network.conv.1.size": 1, "network.conv.0.pool": 1,
              "network.conv.1.padding": 0, "network.classes": 1, "cluster.workers": 1,
              "cluster.use_workers": 1, "data.train_samples": 1, "data.seed": 0,
              "reference.threads": 1, "workspace.channel_quantum": 1}
FLOATS = {"train.lr": (0.0, None, True), "train.weight_decay": (0.0, None, False),
          "train.momentum": (0.0, 1.0, False), "cluster.wait_timeout": (0.0, None, True),
          "workspace.wait_timeout": (0.0, None, True)}  # (low, high, low excluded)


def out_of_range(name: str) -> st.SearchStrategy:
    if name in INTS_BELOW:
        return st.integers(-10**6, INTS_BELOW[name] - 1)
    low, high, low_open = FLOATS[name]
    # No subnormals (nor exclude_max, which steps to one): a run in this process may
    # have set the CPU to flush them to zero, which hypothesis refuses to work under.
    below = st.floats(max_value=low if low_open else low - 1e-9, allow_nan=False,
                      allow_subnormal=False)
    above = (st.floats(min_value=high, allow_nan=False, allow_subnormal=False)
             if high is not None else st.nothing())
    return st.one_of(below, above, st.sampled_from([float("nan"), float("inf")]))


@FAST
@given(st.data())
def test_a_number_out_of_range_is_refused_naming_it(data):
    name = data.draw(st.sampled_from(sorted(INTS_BELOW) + sorted(FLOATS)), label="field")
    value = data.draw(out_of_range(name), label="value")
    assert_refused("train", [SMALL, *TRAIN_BASE, f"{name}={render(value)}"], name)


#: Integers past a field's top (`steps`: a run of 10^23 steps ate the client's memory;
#: `seed`: torch's generators overflowed at the first step), and one too large for a
#: float (``math.isfinite`` overflowed checking it); `image_size`: 100000 asked for
#: terabytes.
TOO_LARGE = {"train.steps": [10**9 + 1, 2**63 - 1, 10**23],
             "train.seed": [2**64, 10**20], "data.seed": [10**400],
             "data.image_size": [513, 100000]}


@pytest.mark.parametrize("name,value", [
    pytest.param(name, value, id=f"{name}-{len(str(value))}-digits")
    for name, values in TOO_LARGE.items() for value in values])
def test_an_integer_past_its_field_s_top_is_refused_naming_it(name, value):
    assert_refused("train", [SMALL, *TRAIN_BASE, f"{name}={value}", "--check"], name)


def test_the_largest_steps_and_seed_are_taken():
    config = checked_config([SMALL, *TRAIN_BASE, "train.steps=1000000000",
                             f"train.seed={2**64 - 1}", "--check"])
    assert config["train"]["steps"] == 10**9 and config["train"]["seed"] == 2**64 - 1


def test_fresh_beside_resume_names_the_field_once():
    status, lines, _ = run_main("train", [SMALL, *TRAIN_BASE, "train.resume=true",
                                          "--fresh", "--check"])
    assert_one_error_line(status, lines, 2, "train.fresh")
    assert lines[0].count("train.fresh") == 1, lines


# pipeline.train: valid mutations ------------------------------------------------------

REFERENCE = to_dict(load_run_config(SMALL, TRAIN_BASE))


def checked_config(argv: list[str]) -> dict:
    """The config a valid command line means (after its --check passed)."""
    assert_accepted("train", argv)
    config, check_only = train_cli.load_checked(argv)
    assert check_only
    return to_dict(config)


@FAST
@given(st.sampled_from(sorted(FLOATS)), st.integers(1, 9), st.integers(-6, -1),
       st.sampled_from(["{m}e{e}", "{m}E{e}", "{m}.0e{e}", "{m}e{e:+d}", "0.{m}e{e1:+d}"]))
def test_numbers_in_exponent_form_are_numbers(name, mantissa, exponent, form):
    text = form.format(m=mantissa, e=exponent, e1=exponent + 1)
    config = checked_config([SMALL, *TRAIN_BASE, f"{name}={text}", "--check"])
    assert get(config, tuple(name.split("."))) == float(text)
    mutated = copy.deepcopy(SMALL_DATA)  # the same number written in the file
    section, key = name.split(".")
    mutated.setdefault(section, {})[key] = "__NUMBER__"
    path = os.path.abspath("exponent.yaml")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(yaml.safe_dump(mutated, sort_keys=False).replace("__NUMBER__", text))
    config = checked_config([path, *TRAIN_BASE, "--check"])
    assert get(config, (section, key)) == float(text)


@FAST
@given(st.sampled_from(["train.lr", "train.weight_decay", "cluster.wait_timeout",
                        "workspace.wait_timeout"]), st.integers(1, 1000))
def test_an_integer_where_a_number_is_wanted_is_accepted(name, value):
    config = checked_config([SMALL, *TRAIN_BASE, f"{name}={value}", "--check"])
    stored = get(config, tuple(name.split(".")))
    assert stored == value and isinstance(stored, float)


def shuffled(node: Any, order: st.DataObject) -> Any:
    if isinstance(node, dict):
        items = order.draw(st.permutations(list(node.items())))
        return {k: shuffled(v, order) for k, v in items}
    if isinstance(node, list):
        return [shuffled(v, order) for v in node]
    return node


@FAST
@given(st.data())
def test_keys_in_any_order_mean_the_same_config(data):
    path = write(shuffled(SMALL_DATA, data), "small.yaml")  # same name: same default name
    assert checked_config([path, *TRAIN_BASE, "--check"]) == REFERENCE


VALID_OVERRIDES = ["train.lr=1e-3", "train.batch=32", "network.conv.1.kernels=48",
                   "cluster.use_workers=3", "train.momentum=0"]


@FAST
@given(st.permutations(["--check", ("--scheduler", SCHEDULER), *TRAIN_BASE, *VALID_OVERRIDES]),
       st.sampled_from([None, *VALID_OVERRIDES]))
def test_options_and_overrides_in_any_order_mean_the_same(units, repeated):
    argv: list[str] = [SMALL]  # the config is the first positional; options go anywhere
    for unit in units:
        argv.extend(unit if isinstance(unit, tuple) else [unit])
    if repeated:  # an override given twice: the last one counts
        key = repeated.split("=")[0]
        argv += [f"{key}=7", repeated]
    expected = to_dict(load_run_config(SMALL, [*TRAIN_BASE, *VALID_OVERRIDES,
                                               f"cluster.scheduler={SCHEDULER}"]))
    with mock.patch("pipeline.train.check_scheduler_answers"):  # the order is under test
        assert checked_config(argv) == expected


@FAST
@given(st.data())
def test_an_unknown_option_anywhere_is_refused_naming_it(data):
    word = data.draw(WORDS.filter(lambda w: not any(
        o.startswith(f"--{w}") for o in ("--check", "--scheduler", "--help"))), label="option")
    argv = [SMALL, *TRAIN_BASE, "train.lr=1e-3", "--check"]
    argv.insert(data.draw(st.integers(0, len(argv)), label="at"), f"--{word}")
    assert_refused("train", argv, f"--{word}")


# experiments.sweep.cli ----------------------------------------------------------------------

SWEEP_OUT = ["--out", os.path.join("results", "prop.zarr")]


@SLOW
@given(st.data())
def test_a_retyped_sweep_value_is_refused_naming_it(data):
    path = data.draw(st.sampled_from(leaves(QUICK_DATA)), label="leaf")
    value = data.draw(wrong_values(get(QUICK_DATA, path)), label="value")
    mutated = copy.deepcopy(QUICK_DATA)
    get(mutated, path[:-1])[path[-1]] = value
    assert_refused("sweep", [write(mutated, "quick.yaml"), "--dry-run", *SWEEP_OUT], under(path))


@SLOW
@given(st.data())
def test_a_renamed_sweep_key_is_refused_naming_it(data):
    path = data.draw(st.sampled_from([k for k in keys(QUICK_DATA) if k[0] != "axes"]),
                     label="key")
    suffix = data.draw(WORDS, label="suffix")
    mutated = copy.deepcopy(QUICK_DATA)
    parent = get(mutated, path[:-1])
    parent[f"{path[-1]}{suffix}"] = parent.pop(path[-1])
    assert_refused("sweep", [write(mutated, "quick.yaml"), "--dry-run", *SWEEP_OUT],
                   under((*path[:-1], f"{path[-1]}{suffix}")))


@SLOW
@given(st.permutations(["--dry-run", ("--out", SWEEP_OUT[1]), "axes.train.batch=[32,64]",
                        "repeats=2", "train.lr=1e-3"]))
def test_sweep_options_and_overrides_in_any_order(units):
    argv: list[str] = [QUICK]
    for unit in units:
        argv.extend(unit if isinstance(unit, tuple) else [unit])
    out = assert_accepted("sweep", argv)
    assert "48 points (6 strategy x 2 workers x 2 batch x 2 repeat(s))" in out
    assert not os.path.exists(SWEEP_OUT[1])
