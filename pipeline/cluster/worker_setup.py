"""Setting a cluster's workers up for a run (`WorkerSetup`: threads, emulated speeds,
devices) and taking the setup back after, so that it never outlives the run.

Apart from connect.py because a run sets up whatever cluster it was given, started
here or not, and the setup's lifetime is the run's, not the client's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import pickle
import sys
import time
from typing import Any, Callable, Iterator

from distributed import Client

from pipeline.config.cluster_config import ClusterConfig
from pipeline.cluster.worker_limits import check_worker_limits
from pipeline.cluster.workers import (ClusterError, fence_workers, live_workers,
                                      scheduler_address, unresponsive)
from tasks.setup_gate import SETUP_NAME, RunSetup
from tasks.worker_state import WorkerSetup


#: Seconds the scheduler has to set every worker up (`register_setup`), and a worker
#: then to answer a direct call.
SETUP_S, PROBE_S = 60.0, 5.0

#: How many times a setup that failed because a worker left the cluster meanwhile is
#: tried again on the workers left: a worker whose process ends as the run starts
#: (its host shut down, killed for memory) is then no more than the loss of a worker
#: before placement, which places over the others.
SETUP_TRIES, LEFT_WAIT_S = 3, 3.0


def setup_name(client: Client) -> str:
    """The name `register_setup` gives its plugin: one per client, so that a run that
    ends removes its own setup and never another run's on the same cluster."""
    return f"{SETUP_NAME}-{client.id}"


def setup_scope(config: ClusterConfig) -> tuple[tuple[str, ...], str | None] | None:
    """Which workers `register_setup` sets up for `config` (`RunSetup`): on a cluster
    the user started, those offering its tags, and its master, as (tags, master);
    None: every worker (an embedded cluster's, or batch jobs', all of them the run's).
    A sweep whose points differ in it sets the workers up again."""
    if scheduler_address(config) is None:
        return None
    return tuple(config.tags()), config.master


def register_setup(client: Client, config: ClusterConfig) -> None:
    """Install `WorkerSetup` on every worker that may be one of the run's (threads,
    emulated speeds and devices by name, for the embedded cluster's workers): on a
    cluster the user started, those offering one of its tags and its master
    (`RunSetup`); Dask registers the plugin on the others too, where it does
    nothing (they may have a memory limit too small for torch). A failed install is taken back
    (`unregister_setup`): the scheduler keeps a plugin it could not install
    everywhere, and runs it again on every worker that joins, a restarted one too.
    A setup broken by a worker that left the cluster meanwhile is tried again on the
    others (`SETUP_TRIES`), with a warning naming it."""
    threads, speeds, devices = {}, {}, {}
    embedded = scheduler_address(config) is None
    if embedded:
        for worker in config.worker_list():
            threads[worker.name] = worker.threads
            speeds[worker.name] = worker.speed
            devices[worker.name] = worker.device
    scope = setup_scope(config)
    setup = WorkerSetup(threads_by_name=threads, speed_by_name=speeds,
                        device_by_name=devices, embedded=embedded)
    plugin = RunSetup(pickle.dumps(setup), None if scope is None else list(scope[0]),
                      config.master)
    for attempt in range(SETUP_TRIES):
        before = _worker_names(client)
        try:
            client.sync(client._register_worker_plugin, plugin=plugin,
                        name=setup_name(client), idempotent=False, callback_timeout=SETUP_S)
            return
        except TimeoutError:  # the scheduler waits on every worker: a frozen one never answers
            _fence_silent(client)
            return
        except Exception as error:  # noqa: BLE001 - the workers' exception arrives as text
            unregister_setup(client)
            broken = isinstance(error, OSError)  # a connection, not the setup's own code
            gone = _left_since(client, before) if broken else []
            if broken and attempt + 1 < SETUP_TRIES:
                what = (f"{', '.join(gone)} left the cluster meanwhile (its process ended?); "
                        "setting up the others again" if gone else
                        f"a connection to a worker broke ({type(error).__name__}); setting the "
                        "workers up again")  # a nanny may have restarted it under its name
                print(f"warning: setting up the workers: {what}", file=sys.stderr)
                continue
            raise ClusterError(f"setting up the workers failed: {error}"
                               f"{_setup_hint(client, error, gone)}") from None


def _worker_names(client: Client) -> set[str] | None:
    """The names of the scheduler's workers now; None if it cannot say (the run's next
    question of the scheduler says why)."""
    try:
        return {str(info.get("name", address))
                for address, info in live_workers(client, patience=2.0).items()}
    except Exception:  # noqa: BLE001 - SchedulerLost is raised by the run's next step
        return None


def _left_since(client: Client, before: set[str] | None) -> list[str]:
    """The names of `before`'s workers that left the cluster: a setup broken by a lost
    connection, asked for `LEFT_WAIT_S`, as the scheduler may hear of the loss just
    after the broken broadcast."""
    deadline = time.monotonic() + LEFT_WAIT_S
    while True:
        now = _worker_names(client)
        if before is None or now is None:
            return []
        gone = sorted(before - now)
        if gone or time.monotonic() > deadline:
            return gone
        time.sleep(0.1)


def _setup_hint(client: Client, error: Exception, gone: list[str]) -> str:
    """What the failed setup's line adds: the workers that left during it, or a
    connection that broke (again and again: `SETUP_TRIES` times), or those whose
    Python lacks this project."""
    if gone:
        return (f"; {', '.join(gone)} left the cluster while it was set up, "
                f"{SETUP_TRIES} times running (do its workers keep dying?)")
    if isinstance(error, OSError):
        return f"; {SETUP_TRIES} times running (do its workers keep dying?)"
    if "No module named" in str(error):
        lacking = ", ".join(_without_the_project(client)) or "which it cannot say"
        return (f"; install this project on every worker's Python (pip install -e .): "
                f"it lacks it on {lacking}")
    return ""


def _finds_the_project() -> bool:
    """On a worker: whether its Python finds this project's worker-side package."""
    return importlib.util.find_spec("tasks") is not None


def _without_the_project(client: Client) -> list[str]:
    """The workers, by name, whose Python lacks this project: its function cannot even
    be unpickled there (its module is this project's), or it finds no `tasks`."""
    try:
        found = client.run(_finds_the_project, on_error="return")
        names = {address: str(info.get("name", address))
                 for address, info in live_workers(client).items()}
    except Exception:  # noqa: BLE001 - the line is said without the names
        return []
    return sorted(names.get(address, address) for address, ok in found.items() if ok is not True)


def _fence_silent(client: Client) -> None:
    """After the setup outlived `SETUP_S`: the workers that do not answer a direct call
    (stopped, or their host frozen) are removed from the cluster, as the run's stall
    watch removes one mid-run, and the run goes on with the others, which the
    scheduler set up meanwhile; where every worker answers, the setup was only slow,
    and the run stops."""
    addresses = list(live_workers(client))
    silent = unresponsive(client, addresses, PROBE_S)
    if not silent:
        unregister_setup(client)
        raise ClusterError(f"setting up the workers took more than {SETUP_S:g} s, though "
                           "every worker answers")
    fence_workers(client, silent)
    print(f"warning: setting up the workers: {', '.join(silent)} did not answer within "
          f"{SETUP_S:g} s (stopped, or its host frozen?); removed from the cluster, the run "
          "goes on without", file=sys.stderr)


def unregister_setup(client: Client, timeout: float = 5.0) -> None:
    """Remove the client's setup (`RunSetup`) from the cluster, so that it does not outlive
    the run: a worker restarted later (by its nanny, for memory) would run it again,
    and with a limit too small for torch, be restarted for ever. The scheduler forgets
    the plugin as soon as it reads the request; telling the workers is given
    `timeout` seconds (a stopped worker never answers). Never raises."""
    if client.status != "running":
        return
    with contextlib.suppress(Exception):
        client.sync(client._unregister_worker_plugin, name=setup_name(client),
                    callback_timeout=timeout)


def remove_orphaned_setups(client: Client) -> list[str]:
    """Remove from the scheduler the setups (`setup_name`) of earlier runs whose client
    is no longer connected to it, and return their names. A run that could not remove
    its own (its scheduler frozen until the run stopped, its process killed) left it
    registered, and the scheduler installs it on every worker that joins later:
    torch imported, the dead run's threads and speeds applied. Removed from the
    scheduler's table only (workers that joined meanwhile keep what it set, as they
    would after a run that ended well); nothing waits on the workers. Nested so that
    cloudpickle sends it by value: the scheduler's Python need not have this project."""
    prefix = f"{SETUP_NAME}-"

    def remove(dask_scheduler: Any) -> list[str]:
        orphaned = sorted(name for name in dask_scheduler.worker_plugins
                          if name.startswith(prefix)
                          and name[len(prefix):] not in dask_scheduler.clients)
        for name in orphaned:
            dask_scheduler.worker_plugins.pop(name, None)
        return orphaned

    return list(client.run_on_scheduler(remove))


def orphaned_setups_line(names: list[str]) -> str:
    """What a run says when it removed earlier runs' setups (`remove_orphaned_setups`)."""
    runs = "an earlier run" if len(names) == 1 else f"{len(names)} earlier runs"
    return (f"note: setting up the workers: removed the setup of {runs} whose client has left "
            f"the scheduler ({', '.join(names)}), which set up every worker that joined "
            "since")


@contextlib.contextmanager
def workers_set_up(client: Client, config: ClusterConfig) -> Iterator[None]:
    """`register_setup` for the block, `unregister_setup` after it, however it ends."""
    register_setup(client, config)
    try:
        yield
    finally:
        unregister_setup(client)


@contextlib.contextmanager
def run_workers_set_up(client: Client, config: ClusterConfig,
                       say: Callable[[str], None]) -> Iterator[None]:
    """A run's workers made ready for the block, as a run's start and a sweep's
    connection make them: on a cluster the user started, the setups earlier runs left
    removed (`remove_orphaned_setups`, said); the workers' memory limits checked
    (`check_worker_limits`); the run's setup for the block (`workers_set_up`)."""
    if scheduler_address(config) is not None:
        orphaned = remove_orphaned_setups(client)
        if orphaned:
            say(orphaned_setups_line(orphaned))
    check_worker_limits(client, config, live_workers(client))
    with workers_set_up(client, config):
        yield
