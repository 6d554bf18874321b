"""What the command-line entry points share: bad input as one line on stderr.

A user who mistypes an option, a field or a path gets one line naming it and an
exit status that says whose fault it was (2: the input, 1: the run), never a usage
block or a traceback. argparse's own complaints go the same way.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn

CONFIG_ERROR = 2  # the input is wrong: config, option, path
RUNTIME_ERROR = 1  # the input was fine, the run failed (cluster, worker, disk)
IN_USE = 3  # the output directory (or sweep store) is held by another run


class UsageError(ValueError):
    """The command line itself is wrong (unknown option, missing argument)."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser that raises UsageError instead of printing a usage block and
    exiting, so that `main(argv)` reports it like every other bad input (and tests
    can call `main` in-process)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def quiet_dask() -> None:
    """Keep only Dask's errors on stderr: its client logs its own view of a failure
    (closed comms, reconnect attempts, at INFO and WARNING), and the run reports every
    failure itself, in one line."""
    logging.getLogger("distributed").setLevel(logging.ERROR)


def error_line(error: BaseException | str) -> str:
    """``error: <message>`` on one line, whatever newlines the message carried."""
    text = " ".join(str(error).split()) or type(error).__name__
    return f"error: {text}"


def fail(error: BaseException | str, status: int) -> int:
    """Print the one line for `error` and hand back the exit status."""
    print(error_line(error), file=sys.stderr)
    return status
