"""A task's call sealed in bytes, so that the Dask scheduler never unpickles it.

The scheduler unpickles every task graph it receives, and unpickling a function, or
an object handed to it, imports the module that defines it. The run's tasks name
tasks.step_task and hand over the strategies' `WorkerSide`s, which import torch: a
fresh `dask scheduler` imported torch on a run's first graph, its event loop blocked
meanwhile (1-3 s here, 15 s on a loaded machine: heartbeats and the client went
unanswered, and a short `cluster.scheduler_timeout` declared it lost), and held
torch's memory (78 MB grew to 271 MB) on what is often a login node.

Sealed, a task's graph names only `run_sealed` (this module, which imports nothing
the scheduler lacks) and one bytes argument; the worker unpickles the call, and only
there are the function's module and its arguments' classes imported.
"""

from __future__ import annotations

from typing import Any, Callable

from distributed import Future
from distributed.protocol.pickle import dumps, loads

__all__ = ["run_sealed", "seal"]


def seal(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """`function(*args, **kwargs)` as bytes, pickled as Dask pickles a task (cloudpickle
    where plain pickle cannot: a lambda, a nested function). A Future among the
    arguments (or in a list or tuple of them) is refused: sealed, it would be no
    dependency of the task, and the function would get the Future, not its result."""
    values = [*args, *kwargs.values()]
    for value in [*values, *(v for held in values if isinstance(held, (list, tuple))
                             for v in held)]:
        if isinstance(value, Future):
            raise TypeError(f"{getattr(function, '__name__', function)}: a Future as an "
                            "argument of a sealed call; order the task after it instead")
    return dumps((function, args, kwargs))


def run_sealed(call: bytes, *_after: Any) -> Any:
    """Run a call `seal` made. `_after` holds the results of the tasks this one was
    ordered after (Dask passes them in); the call does not take them."""
    function, args, kwargs = loads(call)
    return function(*args, **kwargs)
