"""What a linked run leaves on the machine, and taking it away again.

A linked run (pipeline/cluster/links.py) creates namespaces, interfaces, processes and pins
that outlive it if its process is killed. So before it builds anything it writes what
it will create to a record under `RECORDS` (`write_record`), and every linked run's
start removes the leftovers of runs whose owner process is gone (`sweep_leftovers`);
`LinkedHosts.close` removes its own through the same `remove_leftovers`. A process is
named by its pid *and* its start time, so a pid the system gave to another process
since is never killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time

import psutil

RECORDS = "/run/hetcnn-links"


def record_path(run_id: str) -> str:
    """Where run `run_id`'s record is (under `RECORDS` as it is when called)."""
    return os.path.join(RECORDS, f"{run_id}.json")


def write_record(run_id: str, record: dict) -> None:
    """Write (or replace, whole) run `run_id`'s record, owned by this process."""
    os.makedirs(RECORDS, exist_ok=True)
    me = os.getpid()
    temporary = f"{record_path(run_id)}.{me}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump({"owner": [me, started_at(me)], **record}, f)
    os.replace(temporary, record_path(run_id))


def quiet(*command: str) -> None:
    """A clean-up step: whatever is already gone stays gone."""
    subprocess.run(command, capture_output=True)


def namespace_pids(namespace: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()]


def kill_started(pids: list[tuple[int, float | None]], patience: float = 5.0) -> None:
    """SIGKILL each pid that is still the process that started at its time (None: any),
    and wait (at most `patience` s) until they are gone."""
    victims = []
    for pid, started in pids:
        try:
            process = psutil.Process(pid)
            if started is None or abs(process.create_time() - started) < 1e-3:
                process.kill()
                victims.append(process)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=patience)


def started_at(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None


def stop_processes(processes: list[subprocess.Popen], patience: float = 5.0) -> None:
    """SIGTERM (and SIGCONT, should one be stopped) each, wait `patience` s for them
    together, SIGKILL those left; no wait after that (see `LinkedHosts.close`)."""
    for process in processes:
        process.send_signal(signal.SIGTERM)
        process.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + patience
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()


def descendants(processes: list[subprocess.Popen]) -> list[tuple[int, float | None]]:
    """(pid, start time) of every descendant of `processes`, for `kill_started`."""
    try:
        return [(child.pid, child.create_time()) for process in processes
                for child in psutil.Process(process.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def remove_leftovers(record: dict) -> None:
    """End a run's processes (sshfs ends by unmounting: the mount namespace goes with its
    last process), then delete its namespaces (and veths with them), interfaces, files,
    pins (and each pinned directory, if that leaves it empty)."""
    inside = [(pid, None) for ns in record["namespaces"] for pid in namespace_pids(ns)]
    kill_started(inside + [(pid, started) for pid, started in record["pids"]])
    for namespace in record["namespaces"]:
        quiet("ip", "netns", "del", namespace)
    for interface in record["interfaces"]:
        if os.path.exists(f"/sys/class/net/{interface}"):
            quiet("ip", "link", "del", interface)
    shutil.rmtree(record["directory"], ignore_errors=True)
    for pin in record.get("pins", []):  # last: the mounts went with the processes
        with contextlib.suppress(OSError):
            os.remove(pin)
        with contextlib.suppress(OSError):  # fails unless that left the folder empty
            os.rmdir(os.path.dirname(pin))


def _owner_gone(record: dict) -> bool:
    pid, started = record["owner"]
    return started_at(pid) is None or abs(started_at(pid) - started) > 1e-3


def sweep_leftovers() -> list[str]:
    """Remove what runs whose owner process is gone left behind; their run ids."""
    removed = []
    if not os.path.isdir(RECORDS):
        return removed
    for name in sorted(os.listdir(RECORDS)):
        path = os.path.join(RECORDS, name)
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue  # being written (temporary files) or not ours
        if name.endswith(".json") and _owner_gone(record):
            remove_leftovers(record)
            try:
                os.remove(path)
            except FileNotFoundError:
                continue  # another run starting at the same time swept it first
            removed.append(name[:-len(".json")])
    return removed
