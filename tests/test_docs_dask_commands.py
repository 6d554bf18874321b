"""Every option README.md and docs/*.md give a `dask scheduler` or `dask worker` is one
that command takes, as its `--help` lists it.

Why: a user starting a cluster by hand copies these commands, and an option the
command lacks stops it at once (`Error: No such option '--local-directory'`, which
clusters.md once gave `dask scheduler` for its scratch folder). The options are read
from commands in code (inline or indented blocks, continuation lines joined) and from
prose that hands an option to a command ("`--opt DIR` on `dask scheduler` and `dask
worker`", "give each `dask scheduler` and `dask worker` a `--opt`").
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OPTION = r"--[a-z][\w-]*"
COMMAND = r"`dask (?:scheduler|worker)`"


def given_options(text: str) -> list[tuple[str, str]]:
    """(command, option) for every option the text gives `dask scheduler`/`dask worker`."""
    text = re.sub(r"\\\n\s*", " ", text)
    found = []
    for code in re.finditer(r"`([^`\n]*)`|^ {4,}(.*)$", text, re.M):
        span = code.group(1) if code.group(1) is not None else code.group(2)
        for command in re.finditer(r"\bdask (scheduler|worker)\b(.*?)"
                                   r"(?=\bdask (?:scheduler|worker)\b|#|$)", span):
            found += [(command.group(1), o)
                      for o in re.findall(rf"(?<![\w-]){OPTION}", command.group(2))]
    prose = [rf"`({OPTION})[^`]*` on ((?:{COMMAND}(?:,? and |, )?)+)",
             rf"give each ((?:{COMMAND}(?:,? and |, )?)+) an? `({OPTION})"]
    for index, pattern in enumerate(prose):
        for match in re.finditer(pattern, re.sub(r"\s+", " ", text)):
            option, commands = match.groups() if index == 0 else match.groups()[::-1]
            found += [(c, option) for c in re.findall(r"`dask (scheduler|worker)`", commands)]
    return found


def accepted_options(command: str) -> set[str]:
    dask = os.path.join(os.path.dirname(sys.executable), "dask")
    usage = subprocess.run([dask, command, "--help"], capture_output=True, text=True,
                           timeout=120, check=True).stdout
    return set(re.findall(rf"(?<![\w-]){OPTION}", usage))


def test_the_reader_finds_options_in_code_and_prose():
    text = ("    dask worker tcp://h:8786 --nthreads 1 \\\n        --resources CPU=1\n"
            "`dask scheduler --port 1` and `--local-directory DIR` on `dask scheduler` and\n"
            "`dask worker`; give each `dask worker` a `--memory-limit` of its own")
    assert sorted(given_options(text)) == [
        ("scheduler", "--local-directory"), ("scheduler", "--port"),
        ("worker", "--local-directory"), ("worker", "--memory-limit"),
        ("worker", "--nthreads"), ("worker", "--resources")]


@pytest.mark.parametrize("command", ["scheduler", "worker"])
def test_every_option_the_docs_give_a_dask_command_is_one_it_takes(command):
    given = {(doc.name, option) for doc in DOCS
             for which, option in given_options(doc.read_text(encoding="utf-8"))
             if which == command}
    assert given, f"the docs give `dask {command}` no option: the reader is broken"
    accepted = accepted_options(command)
    wrong = sorted((name, option) for name, option in given if option not in accepted)
    assert not wrong, f"options `dask {command} --help` does not list: {wrong}"
