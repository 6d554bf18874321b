"""Faults across the link (pipeline/cluster/links.py): a worker's link cut, a worker stopped
in its namespace, and the store's server stopped, in real processes.

A cut link and a stopped worker are one fault to the run: a worker that does not
answer while it holds the run's tasks (the stall watch, pipeline/engine/stalls.py). It is
fenced off and recovered from on the survivors, and the float64 weights equal plain
PyTorch's; its late writes, once its link is back (or it is woken), land nowhere. A
store that stops answering (the links' sshd and its sessions SIGSTOPped: every
sshfs call then blocks) stalls every worker at once, which no recovery gets past:
the run stops with one message naming the stores and the checkpoint kept.

One linked cluster of three workers serves the module (one such cluster at a time on
the machine: `one_cluster_at_once`): the store test first (all three wait on the
store), then one run that loses w1 (link cut) and then w2 (SIGSTOP). These faults
are rows of tests/test_faults.py's `FAULTS`. The probe helpers (`stall_verdict`,
`silent_stores`) and what a woken worker does in its ended run's workspace are
checked without root.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import subprocess
import tempfile
import threading
import time
from dataclasses import replace

import numpy as np
import psutil
import pytest

from pipeline.cluster import link_records
from pipeline.cluster import links
from pipeline.cluster.linked import open_linked_cluster
from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import ClusterError, live_workers
from pipeline.run import run_training
from pipeline.engine.stalls import StoreStalled, stall_verdict
from storage import checkpoints, liveness
from storage.arrays import open_cached
from storage.exchange import Exchange, ExchangeError, SlotSpec, create_exchange
from storage.exchange_folders import remove_exchange
from storage.private import default_workspace_root
from tests.helpers import max_relative_error, replay_in_pytorch, tiny_config
from tests.test_faults import FAULTS, complete_from

PROBLEM = links.link_problem()
needs_links = pytest.mark.skipif(PROBLEM is not None, reason=f"cluster.link {PROBLEM}")
LIMIT = 2.0  # cluster.stall_timeout, seconds
WORKERS = "[{name: w0}, {name: w1}, {name: w2}]"
NAME = "linkfaults"  # the runs' names start with it, so their workspaces are told apart
#: Held while a test process holds this module's linked cluster (`one_cluster_at_once`).
CLUSTER_LOCK = os.path.join(tempfile.gettempdir(), "hetcnn-test-link-faults.lock")


# Probes (no root) -------------------------------------------------------------------


def test_a_stall_is_judged_by_who_answers_and_what_they_can_list():
    stores = ["/ws", "/ckpt"]
    # a worker that does not answer is stalled; its store is not asked
    assert stall_verdict(["a"], ["a", "b"], {}, {}).workers == ["a"]
    # every worker answers but none can list a store: the store stopped
    verdict = stall_verdict([], ["a"], {"a": stores, "b": ["/ws"]}, {})
    assert verdict.workers == [] and verdict.stores == ["/ws"]
    assert stall_verdict([], ["a"], {"a": ["/ws"], "b": ["/ckpt"]}, {}).stores == stores
    # one worker cut off from a store: stalled on the second probe in a row, not the first
    assert stall_verdict([], ["a", "b"], {"a": ["/ws"], "b": []}, {}).workers == []
    again = stall_verdict([], ["a", "b"], {"a": ["/ws"], "b": []}, {"a": ["/ws"]})
    assert again.workers == ["a"] and again.stores == ["/ws"]
    # a worker not holding the run's tasks is never fenced for its store
    assert stall_verdict([], ["b"], {"a": ["/ws"], "b": []}, {"a": ["/ws"]}).workers == []
    # all busy and every store answers: nothing to do
    assert stall_verdict([], ["a"], {"a": [], "b": []}, {}) == stall_verdict([], [], {}, {})


def test_a_listing_that_never_comes_back_is_silent(tmp_path, monkeypatch):
    """`silent_stores` returns within its limit although a listing blocks for good."""
    frozen = threading.Event()
    real = liveness.list_store

    def listing(path: str) -> None:
        if path.endswith("frozen"):
            frozen.wait(30)  # a store that does not answer
        real(path)

    monkeypatch.setattr(liveness, "list_store", listing)
    paths = [str(tmp_path), str(tmp_path / "missing"), str(tmp_path / "frozen")]
    started = time.monotonic()
    try:
        assert asyncio.run(liveness.silent_stores(paths, 0.5)) == [paths[2]]
        assert time.monotonic() - started < 2
        assert liveness.answers(str(tmp_path), 2) and not liveness.answers(paths[2], 0.2)
    finally:
        frozen.set()


def test_a_worker_woken_after_its_run_ended_neither_waits_nor_makes_its_workspace(tmp_path):
    """What a fenced-off worker does once it runs again (its link back, SIGCONT): its
    run's workspace is gone (the client removed it before the recovery). A wait
    gives up within a quarter second, and a slot's first write fails rather than
    make the workspace's folders again (a folder without an owner record, which no
    later run would remove)."""
    path = str(tmp_path / "ended.zarr")
    create_exchange(path, [SlotSpec("act/0/1", (2, 3), "float64")])
    exchange = Exchange(path)
    open_cached(exchange.data, "act/0/1")  # the worker had opened the slot, not written it
    remove_exchange(path)
    started = time.monotonic()
    with pytest.raises(ExchangeError, match="workspace is gone"):
        exchange.wait("act/0/1", 3, timeout=5)
    assert time.monotonic() - started < 1
    with pytest.raises(FileNotFoundError):
        exchange.write("act/0/1", 3, np.zeros((2, 3)))
    assert not os.path.exists(path)


# Real links (root) ------------------------------------------------------------------


@contextlib.contextmanager
def one_cluster_at_once(timeout: float = 600):
    """Wait (at most `timeout` s) until no other test process holds this module's linked
    cluster, and hold it. pytest-xdist may hand the module's two linked tests to two
    processes (worksteal gives the cut test to an idle one), and two 3-worker linked
    clusters on a loaded 2-core machine starve each other's workers past the 2 s
    stall limit: a run then fenced off every worker while they loaded their shards
    (seen twice in two `-n 2` runs of this file at load 13)."""
    with open(CLUSTER_LOCK, "a", encoding="utf-8") as handle:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, f"{CLUSTER_LOCK} held for {timeout} s"
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def linked(tmp_path_factory, tiny_dataset_factory):
    """Three workers behind 1gbit links, one such cluster at a time on the machine
    (`one_cluster_at_once`); every run of the module writes under `base`."""
    dataset = tiny_dataset_factory("float64")
    base = tmp_path_factory.mktemp("linkfaults")
    cluster = tiny_config(base, dataset, **{"cluster.link.rate": "1gbit",
                                            "cluster.workers": WORKERS,
                                            "cluster.wait_timeout": 120}).cluster
    cluster = replace(cluster, stall_timeout=LIMIT)
    directories = [default_workspace_root(), os.path.dirname(dataset), str(base)]
    with one_cluster_at_once(), open_linked_cluster(cluster, directories) as (client, hosts):
        register_setup(client, cluster)
        yield client, hosts, cluster, dataset, base
        run_id = hosts.run_id
    assert not [n for n in os.listdir("/sys/class/net") if run_id in n]
    assert not [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                          text=True).stdout.split() if run_id in n]
    assert not os.path.exists(os.path.join(link_records.RECORDS, f"{run_id}.json"))


def _config(linked, name: str, steps: int):
    """The run config of test `name`; the run is named `linkfaults-<name>`, so that
    each test finds its own run's workspaces (`_workspaces`)."""
    client, hosts, cluster, dataset, base = linked
    config = tiny_config(base / name, dataset, **{
        "name": f"{NAME}-{name}", "network.dtype": "float64", "train.steps": steps,
        "train.checkpoint_every": 2, "train.eval_samples": 0,
        "network.conv.0.kernels": 12, "network.conv.1.kernels": 12})
    config.cluster = cluster
    return config


def _in_thread(config, client) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def train() -> None:
        try:
            outcome["result"] = run_training(config, client=client)
        except BaseException as error:  # noqa: BLE001 - reported by the asserts
            outcome["error"] = error
            outcome["at"] = time.monotonic()

    runner = threading.Thread(target=train, daemon=True)
    runner.start()
    return runner, outcome


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} after {timeout} s"
        time.sleep(0.02)


def _checkpoint(config, runner, at_least: int) -> None:
    wait_until(lambda: complete_from(config.checkpoint_path, at_least) >= at_least
               or not runner.is_alive(), 120, f"no checkpoint {at_least}")


def _state(process: psutil.Process) -> str:
    """A process's state and what it waits on, for a failure's message."""
    try:
        with process.oneshot():
            return (f"{process.status()}, {len(process.threads())} threads, "
                    f"{len(process.net_connections('tcp'))} TCP connections")
    except psutil.Error as error:
        return repr(error)


def _names(client) -> dict[str, str]:
    """By name, from the scheduler itself (`Client.scheduler_info()` may return a
    cache with no workers in it: tests/test_stalls.py's `worker_names`)."""
    return {info["name"]: address for address, info in live_workers(client).items()}


def _running_tasks(client) -> dict[str, list[str]]:
    """The tasks each worker's threads are running (Dask's `active_threads`), for the
    workers running any: a task the client cancelled runs on until its function
    returns."""

    def running(dask_worker) -> list[str]:
        return [str(key) for key in dask_worker.active_threads.values()]

    return {address: keys for address, keys in client.run(running).items() if keys}


def _digest(folder: str) -> dict[str, str]:
    found = {}
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as handle:
                found[os.path.relpath(os.path.join(root, name), folder)] = (
                    hashlib.sha256(handle.read()).hexdigest())
    return found


def _workspaces(run_name: str) -> set[str]:
    """The workspaces of the runs named `run_name` (a workspace's name is its run's
    name, then the run's id). Other processes of this user may be running theirs
    beside them: under pytest-xdist another worker may run this module's other test,
    on a linked cluster of its own, at the same time (worksteal hands it over)."""
    root = default_workspace_root()
    return {n for n in os.listdir(root) if n.startswith(f"{run_name}-")} if os.path.isdir(
        root) else set()


def _new_workspaces(run_name: str, before: set[str]) -> list[str]:
    """Workspaces of `run_name`'s runs made since `before`, each with some of its files
    (for the message)."""
    found = []
    for name in sorted(_workspaces(run_name) - before):
        folder = os.path.join(default_workspace_root(), name)
        files = [os.path.relpath(os.path.join(d, f), folder)
                 for d, _, names in os.walk(folder) for f in names]
        found.append(f"{name}: {sorted(files)[:5]}")
    return found


@needs_links
def test_a_store_that_stops_answering_stops_the_run_with_one_message(linked, capsys):
    """The links' sshd stopped just after checkpoint 2: every worker's task blocks in
    sshfs, every worker still answers Dask, none can list the stores: the run stops
    (no recovery) within the limit, a poll and two probes, with one line naming the
    stores and the checkpoint kept, its workspace removed; once the store answers
    again and the workers' tasks have ended, nothing saved has changed and the
    workspace has not reappeared."""
    assert FAULTS["store's server (sshd) SIGSTOPped mid-run, 3 workers"] == "clean"
    client, hosts, *_ = linked
    config = _config(linked, "store", steps=30)
    before = _workspaces(config.name)
    runner, outcome = _in_thread(config, client)
    _checkpoint(config, runner, 2)
    server = psutil.Process(hosts.processes[0].pid)  # sshd, and a session per mount
    tree = [server, *server.children(recursive=True)]
    for process in tree:
        process.suspend()
    stopped = time.monotonic()
    try:
        runner.join(60)
        assert not runner.is_alive(), "the run hangs on the stopped store"
        kept = _digest(config.checkpoint_path)
        left = _new_workspaces(config.name, before)  # removed before the run returned
    finally:
        for process in tree:
            process.resume()
    answered = time.monotonic()
    assert not left
    error = outcome.get("error")
    assert isinstance(error, StoreStalled) and isinstance(error, ClusterError), outcome
    noticed = outcome["at"] - stopped
    message = str(error)
    assert noticed < LIMIT + 2 + LIMIT + 5 + 6  # limit, poll, probes, close, a busy host
    assert "\n" not in message and "stopped answering" in message
    assert config.checkpoint_path in message and default_workspace_root() in message
    step = checkpoints.latest_complete_step(config.checkpoint_path)
    assert step >= 2 and f"the last complete checkpoint, step {step}, is kept" in message
    assert "train.resume=true" in message
    # the workers' tasks run on, now that the store answers, and fail: whatever they
    # wrote late has landed once none runs
    wait_until(lambda: not _running_tasks(client), 60, "the workers' tasks still run")
    with capsys.disabled():
        print(f"\nstore stopped -> run stopped: {noticed:.1f} s; the workers' tasks ended "
              f"{time.monotonic() - answered:.1f} s after it answered; {message}")
    assert _digest(config.checkpoint_path) == kept
    assert not _new_workspaces(config.name, before)
    assert len(_names(client)) == 3  # nobody was fenced off


@needs_links
def test_a_cut_link_and_a_stopped_worker_are_survived(linked, capsys):
    """w1's link cut just after checkpoint 2, then w2 SIGSTOPped just after the next
    checkpoint of the recovered run: each is noticed by the stall watch (one line
    naming it), fenced off and recovered from; the run ends on w0 with plain
    PyTorch's float64 weights (1e-10). Once fenced off, w1's link is restored and w2
    woken while the run goes on: both exit, and nothing they still had in flight
    lands (every checkpoint matches its checksums, nothing changes after the run,
    no workspace reappears)."""
    assert FAULTS["worker's link cut mid-run, restored after, kernel, float64"] == "survived"
    assert FAULTS["worker SIGSTOPped in its namespace mid-run, kernel, float64"] == "survived"
    client, hosts, _, dataset, _ = linked
    names = _names(client)
    assert sorted(names) == ["w0", "w1", "w2"]
    pids = client.run(os.getpid)
    cut = next(h.interface for h in hosts.hosts if h.name == "w1")
    config = _config(linked, "cut", steps=6)
    before = _workspaces(config.name)
    runner, outcome = _in_thread(config, client)
    noticed, victims = [], [psutil.Process(pids[names[n]]) for n in ("w1", "w2")]
    try:
        _checkpoint(config, runner, 2)
        time.sleep(0.5)  # a step past the checkpoint, most times: it is replayed
        subprocess.run(["ip", "link", "set", cut, "down"], check=True)
        cut_at = time.monotonic()
        wait_until(lambda: "w1" not in _names(client) or not runner.is_alive(), 60,
                   "w1 not fenced off")
        noticed.append(time.monotonic() - cut_at)
        subprocess.run(["ip", "link", "set", cut, "up"], check=True)  # it rejoins nothing
        _checkpoint(config, runner, checkpoints.latest_complete_step(config.checkpoint_path)
                    + 2)
        victims[1].suspend()
        stop_at = time.monotonic()
        wait_until(lambda: "w2" not in _names(client) or not runner.is_alive(), 60,
                   "w2 not fenced off")
        noticed.append(time.monotonic() - stop_at)
        victims[1].resume()
        runner.join(120)
        assert "result" in outcome, outcome
    finally:
        subprocess.run(["ip", "link", "set", cut, "up"], check=True)
        victims[1].resume()
    kept = _digest(config.checkpoint_path)
    ended = time.monotonic()
    gone, alive = psutil.wait_procs(victims, timeout=90)  # slow under load
    assert not alive, "fenced-off workers did not exit once they could: " + ", ".join(
        f"{name} ({_state(process)})" for name, process in zip(("w1", "w2"), victims)
        if process in alive)
    exited = time.monotonic() - ended
    time.sleep(0.5)
    assert _digest(config.checkpoint_path) == kept  # no late write landed
    assert not _new_workspaces(config.name, before)
    err = capsys.readouterr().err
    with capsys.disabled():
        print(f"\nnoticed (fault to fenced off): link cut {noticed[0]:.1f} s, SIGSTOP "
              f"{noticed[1]:.1f} s; both gone {exited:.1f} s after the run; "
              f"recoveries {outcome['result'].summary['recoveries']}")
    for seconds in noticed:  # the limit, a fetch (the cut one held a result) or none,
        assert seconds < LIMIT + LIMIT + LIMIT + 4  # a probe, a busy machine
    lines = [line for line in err.splitlines() if "stalled" in line]
    assert len(lines) == 2 and all("did not answer" in line for line in lines), lines
    assert "worker w1 stalled" in lines[0] and "worker w2 stalled" in lines[1]
    first, second = outcome["result"].summary["recoveries"]
    assert (first["lost_workers"], second["lost_workers"]) == (["w1"], ["w2"])
    assert first["cause"] == second["cause"] == "stalled"
    assert second["workers"] == ["w0"] and second["restored_step"] > first["restored_step"] >= 2
    for recovery in (first, second):
        assert recovery["replayed_steps"] == recovery["lost_at_step"] - recovery["restored_step"]
    record = outcome["result"].record
    assert list(record.step.values) == list(range(config.train.steps))
    expected, _ = replay_in_pytorch(config, dataset)
    got = checkpoints.read_tensors(config.checkpoint_path, config.train.steps)
    assert max_relative_error(got, expected) <= 1e-10
    assert all(checkpoints.damage(config.checkpoint_path, s) is None
               for s in checkpoints.complete_steps(config.checkpoint_path))
