"""Does a store answer? A probe a worker runs on its own event loop.

A store that stops answering (an sshfs mount whose server froze, an NFS server
gone, an object store that accepts connections and never replies) does not fail a
task: the task's thread blocks in the read or write, the worker's event loop runs
on and answers every Dask call, and the run would wait forever. The run finds out
by asking its workers to list the run's stores (`silent_stores`): each listing runs
in a thread of its own, so one that blocks blocks only that thread, and the answer
comes back within the time limit either way. An error (a path gone, a mount whose
server refused) is an answer: it fails the task that meets it, and the run says so.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Callable

import fsspec


def list_store(path: str) -> None:
    """One round trip to the store of `path`: list it (a local path, or an fsspec URL)."""
    if "://" not in path or path.startswith("file://"):
        os.listdir(path.removeprefix("file://"))
        return
    fs, root = fsspec.core.url_to_fs(path)
    fs.ls(root, detail=False)


def _list_in_thread(path: str, done: Callable[[], None]) -> None:
    """List `path` in a daemon thread (one a store that never answers keeps blocked),
    then call `done`, also after an error (an error is an answer)."""

    def listing() -> None:
        try:
            list_store(path)
        except Exception:  # noqa: BLE001 - see the module doc
            pass
        done()

    threading.Thread(target=listing, daemon=True, name=f"store-probe {path}").start()


def answers(path: str, timeout: float) -> bool:
    """Whether a listing of `path` comes back to this process within `timeout` s."""
    finished = threading.Event()
    _list_in_thread(path, finished.set)
    return finished.wait(timeout)


async def silent_stores(paths: list[str], timeout: float) -> list[str]:
    """Those of `paths` whose listing did not come back within `timeout` seconds.

    Run on a worker's event loop (`Client.run` with this coroutine): every path is
    listed at once, each in a thread of its own (no thread of the worker's executor
    is taken, and the loop goes on answering).
    """
    loop = asyncio.get_running_loop()
    answered = {path: loop.create_future() for path in paths}

    def finished(path: str) -> Callable[[], None]:
        def mark() -> None:
            if not answered[path].done():
                answered[path].set_result(True)

        def done() -> None:
            try:
                loop.call_soon_threadsafe(mark)
            except RuntimeError:  # the loop closed while the store held the thread
                pass
        return done

    for path in paths:
        _list_in_thread(path, finished(path))
    await asyncio.wait(list(answered.values()), timeout=timeout)
    return [path for path, future in answered.items() if not future.done()]
