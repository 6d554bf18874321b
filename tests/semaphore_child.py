"""The target of the child process in tests/test_semaphores.py's stop-twice test, in a
module of its own: the child (forked from a fork server) and the stopped script both
import it, and tests/test_semaphores.py imports tests.helpers, with torch (3.5 s of
CPU a process, twice, for a function that needs only multiprocessing)."""

from __future__ import annotations

import multiprocessing
import time


def hold_a_semaphore() -> None:
    """A child's own semaphore (as a worker's), said on stdout and held until killed."""
    lock = multiprocessing.get_context("forkserver").Lock()
    print(lock._semlock.name.lstrip("/"), flush=True)
    time.sleep(120)
