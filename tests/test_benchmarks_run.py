"""The benchmarks run as the docs say: `python -m benchmarks.NAME` from the repository root.

Why: a benchmark is run rarely, long after its last edit, so a broken import or a
command in the docs naming a benchmark that was renamed or removed goes unnoticed
until someone needs the figure again. A benchmark that edits `sys.path` to find the
project hides exactly the import problems `-m` would show, and an old
`python benchmarks/X.py` line in the docs still "works" through it. Checked here:
every module of benchmarks/ imports as `benchmarks.NAME` in a fresh interpreter
started at the root (one for all) and answers `--help` with its usage there, run as
`-m` runs it (so a benchmark starts nothing before it has read its arguments), none
edits `sys.path`, and every benchmark command in README.md, docs/*.md and the
benchmarks' own usage lines is `python -m benchmarks.NAME` with a NAME that exists.
No cluster is started.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
MODULES = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "__init__")
#: Where benchmark commands are quoted for a user to run.
QUOTING = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
           *sorted(BENCHMARKS.glob("*.py"))]
#: `python -m benchmarks.NAME`, possibly wrapped at the space in a paragraph.
MODULE_COMMAND = re.compile(r"python3?\s+-m\s+benchmarks\.(\w+)")
#: `python benchmarks/NAME.py`: the form that needs `sys.path` edited to import.
SCRIPT_COMMAND = re.compile(r"python3?\s+benchmarks/\w+(?:\.py)?")

#: Imports every name given on its command line as `benchmarks.NAME`, then runs each
#: as `python -m benchmarks.NAME --help` would; prints a JSON object {"import": ...,
#: "help": ...} of the names that failed each and why (an error's last line, or what
#: the run did instead of printing its usage and exiting 0).
CHECK_ALL = """
import contextlib, importlib, io, json, runpy, sys, traceback, warnings
warnings.simplefilter("ignore", RuntimeWarning)  # runpy: "found in sys.modules"
names, failed = sys.argv[1:], {"import": {}, "help": {}}
for name in names:
    try:
        importlib.import_module("benchmarks." + name)
    except BaseException:
        failed["import"][name] = traceback.format_exc().strip().splitlines()[-1]
for name in names:
    sys.argv, printed = [name + ".py", "--help"], io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_module("benchmarks." + name, run_name="__main__", alter_sys=True)
        failed["help"][name] = "returned without exiting"
    except SystemExit as done:
        if done.code not in (0, None) or not printed.getvalue().startswith("usage:"):
            failed["help"][name] = f"exit {done.code}: {printed.getvalue()[:80]!r}"
    except BaseException:
        failed["help"][name] = traceback.format_exc().strip().splitlines()[-1]
print(json.dumps(failed))
"""


def fresh_root_environment() -> dict[str, str]:
    """This process's environment without PYTHONPATH: what the root alone provides."""
    return {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


@pytest.fixture(scope="module")
def failures() -> dict[str, dict[str, str]]:
    """`CHECK_ALL`'s answer for every benchmark, in a fresh interpreter at the root."""
    done = subprocess.run([sys.executable, "-c", CHECK_ALL, *MODULES], cwd=ROOT,
                          env=fresh_root_environment(), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def commands(pattern: re.Pattern[str]) -> list[tuple[str, int, str]]:
    """(file relative to the root, line, command text) of every match in `QUOTING`."""
    found = []
    for path in QUOTING:
        text = path.read_text()
        for match in pattern.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((str(path.relative_to(ROOT)), line, " ".join(match.group(0).split())))
    return found


def test_benchmarks_exist():
    assert len(MODULES) >= 10, MODULES


def test_every_benchmark_imports_as_a_module_from_the_root(failures):
    assert failures["import"] == {}


def test_every_benchmark_answers_help_with_its_usage(failures):
    assert failures["help"] == {}


def test_no_benchmark_edits_sys_path():
    editing = [p.name for p in sorted(BENCHMARKS.glob("*.py")) if "sys.path" in p.read_text()]
    assert editing == []


def test_benchmark_commands_run_them_as_modules():
    assert commands(SCRIPT_COMMAND) == []


def test_benchmark_commands_name_existing_benchmarks():
    quoted = commands(MODULE_COMMAND)
    assert len(quoted) >= len(MODULES) // 2, "fewer benchmark commands than expected"
    missing = [(path, line, command) for path, line, command in quoted
               if MODULE_COMMAND.match(command).group(1) not in MODULES]
    assert missing == []


def test_the_command_check_finds_wrapped_and_missing_names():
    """The patterns see a command wrapped at a space, and a name that is not a module."""
    text = "run (`python -m\nbenchmarks.no_such_one --x 1`) or `python\nbenchmarks/old.py`"
    assert [m.group(1) for m in MODULE_COMMAND.finditer(text)] == ["no_such_one"]
    assert "no_such_one" not in MODULES
    assert [" ".join(m.group(0).split()) for m in SCRIPT_COMMAND.finditer(text)] == [
        "python benchmarks/old.py"]
