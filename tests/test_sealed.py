"""A task's call sealed in bytes (tasks/sealed.py): it runs as the call would, a task
ordered after another runs after it without taking its result, and a Future handed
as an argument is refused (sealed, it would be no dependency). That the scheduler
imports no torch is tests/test_cli.py's (a `dask scheduler` process)."""

from __future__ import annotations

import time

import pytest

from pipeline.cluster.workers import find_workers
from pipeline.engine.runner import TaskRunner
from tasks.sealed import run_sealed, seal


def test_a_sealed_call_runs_as_the_call():
    assert run_sealed(seal(int, ("ff",), {"base": 16})) == 255
    assert run_sealed(seal(lambda x, y=0: x + y, (1,), {"y": 2}), "a result") == 3


def test_a_task_is_ordered_after_another_and_a_future_argument_is_refused(three_worker_cluster):
    client, config = three_worker_cluster
    runner = TaskRunner(client, find_workers(client, config)[:2], f"sealed-{time.monotonic_ns()}")
    first = runner.submit(lambda: (time.sleep(0.3), time.time())[1], 0, name="first")
    then = runner.submit(time.time, 1, after=[first], name="then")  # takes no argument
    started, ended = runner.gather([first, then], "ordered")
    assert ended >= started
    with pytest.raises(TypeError, match="a Future as an argument"):
        runner.submit(print, 1, first, name="wrong")
    with pytest.raises(TypeError, match="a Future as an argument"):
        runner.submit(print, 1, deps=[first], name="wrong")
