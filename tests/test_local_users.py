"""Another user of the same machine: they can reach the run's loopback ports and the
shared-memory folder, but must not get into the run.

The hostile user is `nobody`, in a process forked from the test's and switched to
that user (the test's Python lives where `nobody` may not read it, so it is not
started afresh); it needs root to switch, and the tests skip without it. Each
attack is also tried with what the run's own user holds (its credentials, its
uid), so that a refusal is known to come from the defence and not from a broken
attacker.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pwd
import re
import stat
import subprocess
import sys
import tempfile
import traceback
from typing import Any, Callable

import pytest
from distributed.comm import connect

from distributed import Client

from pipeline import preflight, train
from pipeline.cluster.embedded import start_embedded_cluster
from pipeline.cluster.linked import open_linked_cluster
from pipeline.cluster.links import link_problem
from pipeline.config.cluster_config import WorkerConfig
from pipeline.config.run_config import build_run_config
from pipeline.cli import IN_USE
from pipeline.training.outputs import OutputBusy, OutputLock
from experiments.sweep import cli as sweep_cli
from experiments.sweep.results import StoreBusy, SweepLock
from pipeline.cluster.security import run_security
from storage.exchange import SlotSpec, create_exchange
from storage.exchange_folders import remove_exchange, remove_root_if_empty
from storage.private import (UnsafeFolder, default_workspace_root, folder_problem,
                             make_private_folder)
from tests.helpers import error_lines_of

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching to user nobody needs root")
LINK_PROBLEM = link_problem()
needs_links = pytest.mark.skipif(LINK_PROBLEM is not None, reason=f"cluster.link {LINK_PROBLEM}")


def nobody() -> pwd.struct_passwd:
    return pwd.getpwnam("nobody")


def as_user(user: pwd.struct_passwd | None, attempt: Callable[[], Any]) -> dict:
    """Run `attempt` in a forked child as `user` (None: as this process's user);
    returns {"value": its result} or {"error": "Type: message"}."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        try:
            os.close(read)
            if user is not None:
                os.setgroups([])
                os.setgid(user.pw_gid)
                os.setuid(user.pw_uid)
            try:
                outcome = {"value": attempt()}
            except BaseException as error:  # noqa: BLE001 - reported to the parent
                outcome = {"error": f"{type(error).__name__}: {error}",
                           "trace": traceback.format_exc(limit=3)}
            os.write(write, json.dumps(outcome, default=str).encode())
        finally:
            os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks) or b'{"error": "the child wrote nothing"}')


def ask_identity(address: str, connection_args: dict) -> dict:
    """Connect to a Dask server as a client would and call one of its handlers: whoever
    gets an answer can as well submit functions for its workers to run."""

    async def ask() -> dict:
        comm = await connect(address, timeout=5, **connection_args)
        try:
            await comm.write({"op": "identity", "reply": True})
            reply = await asyncio.wait_for(comm.read(), 5)
        finally:
            comm.abort()
        return {"type": reply.get("type"), "workers": len(reply.get("workers", {}))}

    return asyncio.run(ask())


@needs_root
def test_another_user_cannot_talk_to_the_embedded_cluster(shared_cluster):
    """Neither in plain TCP, nor with TLS credentials of its own making, nor without
    any: the cluster speaks mutual TLS with credentials only the run holds."""
    client, _ = shared_cluster
    address = client.scheduler.address
    worker = next(iter(client.scheduler_info()["workers"]))
    plain = f"tcp://{address.split('://', 1)[1]}"
    forged = run_security().get_connection_args("client")  # self-signed by the attacker
    for target in (address, worker):
        for scheme_address, args in ((plain, {}), (target, forged)):
            if target == worker:
                scheme_address = scheme_address.replace(address.split("://", 1)[1],
                                                        worker.split("://", 1)[1])
            outcome = as_user(nobody(), lambda: ask_identity(scheme_address, args))
            assert "error" in outcome, f"{scheme_address} answered user nobody: {outcome}"
    # the run's credentials get an answer, from the same forked child as nobody
    granted = client.security.get_connection_args("client")
    outcome = as_user(nobody(), lambda: ask_identity(address, granted))
    assert outcome.get("value", {}).get("type") == "Scheduler", outcome


@needs_root
def test_no_credentials_on_a_command_line(shared_cluster):
    """The workers' key reaches them in memory: no process's command line holds it."""
    import psutil

    client, _ = shared_cluster
    key_line = client.security.tls_client_key.splitlines()[1]
    for process in psutil.process_iter(["cmdline"]):
        assert key_line not in " ".join(process.info["cmdline"] or ()), process


@needs_root
def test_another_user_cannot_read_or_move_a_run_workspace():
    """The default root is 0700 and the run's own folder too: `nobody` can neither list,
    read nor rename it (the run's user can, from the same forked child)."""
    path = os.path.join(default_workspace_root(), f"users-test-{os.getpid()}.zarr")
    create_exchange(path, [SlotSpec("act/0/1", (4,), "float32")])
    try:
        assert stat.S_IMODE(os.stat(default_workspace_root()).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
        data = os.path.join(path, "data", "act", "0", "1", "zarr.json")
        attacks = {"list": lambda: os.listdir(path),
                   "read": lambda: open(data, "rb").read(1).hex(),
                   "move": lambda: os.rename(path, path + ".moved")}
        for name, attack in attacks.items():
            outcome = as_user(nobody(), attack)
            assert outcome.get("error", "").startswith("PermissionError"), (name, outcome)
        assert "value" in as_user(None, attacks["read"])
    finally:  # as a run's end: the root too, if this test made it and nothing else is there
        remove_exchange(path)
        remove_root_if_empty(default_workspace_root())


@needs_root
def test_a_root_another_user_made_first_is_refused(tmp_path):
    """Made beforehand by `nobody`, open to all (0777): refused with a line naming its
    owner, never used or repaired; a root of the run's user open to writes too."""
    root = tmp_path / "dask-cnn"
    root.mkdir()
    os.chown(root, nobody().pw_uid, nobody().pw_gid)
    os.chmod(root, 0o777)
    with pytest.raises(UnsafeFolder, match="belongs to user nobody"):
        make_private_folder(str(root))
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o777
    os.chown(root, os.getuid(), os.getgid())
    with pytest.raises(UnsafeFolder, match="writable by other users"):
        make_private_folder(str(root))


def test_a_root_of_ours_is_narrowed_and_a_link_refused(tmp_path):
    """A root of the run's user that others may read (an older version made it 0755)
    becomes 0700; a symbolic link where the root should be is refused."""
    root = tmp_path / "mine"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    make_private_folder(str(root))
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    link = tmp_path / "link"
    link.symlink_to(root)
    assert "symbolic link" in folder_problem(str(link))
    made = tmp_path / "new"
    make_private_folder(str(made))
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700


@needs_root
def test_check_refuses_an_unsafe_default_root_in_one_line(tmp_path, monkeypatch, capsys):
    """`--check` (and so every run) names the folder and its owner, exit 2."""
    root = tmp_path / "dask-cnn-taken"
    root.mkdir()
    os.chown(root, nobody().pw_uid, nobody().pw_gid)
    monkeypatch.setattr(preflight, "default_workspace_root", lambda: str(root))
    config = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "small.yaml")
    assert train.main([config, "--check", f"output={tmp_path / 'run'}"]) == 2
    lines = error_lines_of(capsys.readouterr().err)
    assert len(lines) == 1 and str(root) in lines[0] and "nobody" in lines[0], lines


def planted_dask_scratch(tmp_path, monkeypatch):
    """``$TMPDIR/dask-scratch-space`` made first by another user (`nobody` where the
    test is root, else one of the run's user), open to all, $TMPDIR (1777) being
    `tmp_path`'s; returns that folder."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    planted = shared / "dask-scratch-space"
    planted.mkdir()
    os.chmod(planted, 0o777)
    if os.geteuid() == 0:
        os.chown(planted, nobody().pw_uid, nobody().pw_gid)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    return planted


def test_a_killed_runs_scratch_is_removed_by_the_next_cluster_and_no_other(tmp_path,
                                                                          monkeypatch):
    """SIGKILL leaves a run no time to remove its cluster's scratch folder: the next
    private scratch removes this user's folders whose process is gone, and keeps a
    live process's, a link, another name, and (as root) another user's."""
    from pipeline.cluster.embedded import SCRATCH_PREFIX, private_scratch
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"{SCRATCH_PREFIX}{gone.pid}-abc"
    (stale / "worker-x").mkdir(parents=True)
    (stale / "worker-x" / "global.lock").write_text("")
    live = tmp_path / f"{SCRATCH_PREFIX}{os.getppid()}-def"
    live.mkdir()
    other = tmp_path / f"{SCRATCH_PREFIX}x-ghi"
    other.mkdir()
    target = tmp_path / "kept"
    target.mkdir()
    link = tmp_path / f"{SCRATCH_PREFIX}{gone.pid}-link"
    link.symlink_to(target)
    theirs = tmp_path / f"{SCRATCH_PREFIX}{gone.pid}-jkl"
    theirs.mkdir()
    if os.geteuid() == 0:
        os.chown(theirs, nobody().pw_uid, nobody().pw_gid)
    made = private_scratch()
    assert not stale.exists()
    assert live.is_dir() and other.is_dir() and link.is_symlink() and target.is_dir()
    assert theirs.is_dir() == (os.geteuid() == 0)
    assert os.path.basename(made).startswith(f"{SCRATCH_PREFIX}{os.getpid()}-")
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700


def check_private_scratch(client: Client, planted) -> str:
    """Every Dask server of `client`'s cluster keeps its scratch (first on its
    `sys.path`) in a 0700 folder of this user's, none in `planted`, which stays empty;
    returns that folder."""
    folders = {"scheduler": client.run_on_scheduler(
        lambda dask_scheduler: dask_scheduler.local_directory),
        **client.run(lambda dask_worker: dask_worker.local_directory)}
    paths = client.run(lambda: __import__("sys").path[:2])
    assert os.listdir(planted) == [], os.listdir(planted)
    assert all(not p.startswith(str(planted)) for ps in paths.values() for p in ps), paths
    private = set()
    for name, folder in folders.items():
        assert not folder.startswith(str(planted)), (name, folder)
        up = folder
        while not os.path.basename(up).startswith("dask-cnn-scratch-"):
            assert up != "/", (name, folder)
            up = os.path.dirname(up)
        info = os.stat(up)
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (os.getuid(), 0o700), name
        private.add(up)
    assert len(private) == 1, private
    return private.pop()


def test_dask_scratch_another_user_made_first_is_not_used(tmp_path, monkeypatch):
    """Dask's default scratch, ``$TMPDIR/dask-scratch-space``, made first by another
    user and open to all: the embedded cluster's scheduler and workers keep their
    scratch in a 0700 folder of the run's own instead, gone once it closes."""
    planted = planted_dask_scratch(tmp_path, monkeypatch)
    with start_embedded_cluster([WorkerConfig(name="w", resources={"CPU": 1})]) as cluster:
        with Client(cluster, set_as_default=False) as client:
            private = check_private_scratch(client, planted)
    assert not os.path.exists(private), f"{private} outlived its cluster"


@needs_links
def test_dask_scratch_another_user_made_first_is_not_used_by_linked_workers(
        tmp_path, monkeypatch):
    """The same of a `cluster.link` run's cluster: its scheduler, and each `dask worker`
    on a host of its own behind its link."""
    planted = planted_dask_scratch(tmp_path, monkeypatch)
    config = build_run_config({"cluster": {"link": {"rate": "1gbit"}, "workers": 1}})
    with open_linked_cluster(config.cluster, [str(tmp_path / "run")]) as (client, _):
        private = check_private_scratch(client, planted)
    assert not os.path.exists(private), f"{private} outlived its cluster"


def test_a_lock_file_planted_as_a_link_is_refused_and_its_target_kept(tmp_path, capsys):
    """A symbolic link where a sweep store's lock goes (beside the store: in /tmp for
    ``--out /tmp/x.zarr``) or a run's (in its output directory): the holder's record
    was written over the file it names; now the run, the sweep and `--check` refuse it
    in one line, exit 3, and the file stays as it was."""
    target = tmp_path / "precious.txt"
    target.write_text("the user's own file\n")
    store, output = tmp_path / "x.zarr", tmp_path / "run"
    output.mkdir()
    (tmp_path / "x.zarr.lock").symlink_to(target)
    (output / "run.lock").symlink_to(target)
    for lock, busy in ((SweepLock(str(store)), StoreBusy), (OutputLock(str(output)), OutputBusy)):
        for attempt in (lock.acquire, lock.check_free):
            with pytest.raises(busy, match=f"{lock.path} is a symbolic link .to {target}"):
                attempt()
    config = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "small.yaml")
    assert train.main([config, "--check", f"output={output}"]) == IN_USE
    lines = error_lines_of(capsys.readouterr().err)
    assert len(lines) == 1 and "symbolic link" in lines[0], lines
    assert target.read_text() == "the user's own file\n"


@needs_root
def test_a_lock_file_another_user_made_is_refused_unless_held(tmp_path):
    """A lock file of user `nobody`'s, open to writes (0666), in a store's folder: not
    taken over (the run's record never goes into another user's file), one line naming
    its owner; while something holds it, the usual "in use" line."""
    lock_path = tmp_path / "x.zarr.lock"
    lock_path.write_text("{}")
    os.chmod(lock_path, 0o666)
    os.chown(lock_path, nobody().pw_uid, nobody().pw_gid)
    lock = SweepLock(str(tmp_path / "x.zarr"))
    with pytest.raises(StoreBusy, match="belongs to user nobody"):
        lock.acquire()
    assert lock_path.read_text() == "{}"
    with open(lock_path, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(StoreBusy, match="is in use by another sweep"):
            lock.acquire()


@needs_root
def test_an_output_or_store_another_user_made_first_is_refused(tmp_path, capsys):
    """A run's output directory, a sweep's store or its runs folder made first by
    `nobody` (0777, where the run would write its checkpoints and results for them to
    change or link elsewhere): `--check`, the run and the sweep (dry runs too) refuse
    it, exit 2, one line naming it and its owner; nothing is written in it."""
    root = os.path.dirname(os.path.dirname(__file__))
    taken = []
    for name in ("run", "x.zarr", "y.runs"):
        taken.append(tmp_path / name)
        taken[-1].mkdir(mode=0o777)
        os.chown(taken[-1], nobody().pw_uid, nobody().pw_gid)
    run, store, runs = taken
    config = os.path.join(root, "configs", "small.yaml")
    quick = os.path.join(root, "experiments", "configs", "quick.yaml")
    axes = ["axes.strategy=[single]", "axes.cluster.workers=[1]"]
    attempts = [(run, lambda: train.main([config, "--check", f"output={run}"])),
                (run, lambda: train.main([config, f"output={run}", "train.steps=1"])),
                (store, lambda: sweep_cli.main([quick, "--out", str(store), *axes])),
                (store, lambda: sweep_cli.main([quick, "--out", str(store), "--dry-run",
                                                *axes])),
                (runs, lambda: sweep_cli.main([quick, "--out", str(tmp_path / "y.zarr"),
                                               "--dry-run", *axes]))]
    for folder, attempt in attempts:
        assert attempt() == 2, folder
        lines = error_lines_of(capsys.readouterr().err)
        assert len(lines) == 1 and f"{folder} belongs to user nobody" in lines[0], lines
        assert os.listdir(folder) == []


@needs_root
def test_a_workspace_path_others_can_rename_in_is_refused(tmp_path, capsys):
    """A `workspace.path` of `nobody`'s (say /tmp/ws, made before the run), or one every
    user may write in without the sticky bit: they could swap the run's own 0700
    workspace folder there for one of theirs. `--check` (and so the run) refuses it,
    exit 2, one line naming it; a root-owned 1777 folder such as /tmp is fine."""
    config = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "small.yaml")
    theirs, open_to_all, sticky = (tmp_path / "theirs", tmp_path / "open", tmp_path / "tmp")
    for folder, mode in ((theirs, 0o755), (open_to_all, 0o777), (sticky, 0o1777)):
        folder.mkdir()
        os.chmod(folder, mode)
    os.chown(theirs, nobody().pw_uid, nobody().pw_gid)
    for folder, expected in ((theirs, "belongs to user nobody"),
                             (open_to_all, "is writable by every user (mode 777) without")):
        assert train.main([config, "--check", f"output={tmp_path / 'run'}",
                           f"workspace.path={folder}"]) == 2
        lines = error_lines_of(capsys.readouterr().err)
        assert len(lines) == 1 and f"workspace.path: {folder} {expected}" in lines[0], lines
    assert train.main([config, "--check", f"output={tmp_path / 'run'}",
                       f"workspace.path={sticky}"]) == 0


DASHBOARD_REQUEST = """
import os, pwd, sys, urllib.error, urllib.request
from pipeline.cluster.embedded import start_embedded_cluster
from pipeline.config.cluster_config import WorkerConfig
with start_embedded_cluster([WorkerConfig(name="w", resources={"CPU": 1})]) as cluster:
    url = f"http://127.0.0.1:{cluster.scheduler.http_server.port}/sitemap.json"
    pid = os.fork()
    if pid == 0:  # the request, as user nobody where this runs as root
        if os.geteuid() == 0:
            os.setgroups([]); os.setgid(pwd.getpwnam("nobody").pw_gid)
            os.setuid(pwd.getpwnam("nobody").pw_uid)
        try:
            urllib.request.urlopen(url, timeout=10)
        except urllib.error.HTTPError as error:
            print("answered", error.code, flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
"""


def test_another_users_requests_to_the_dashboard_print_nothing():
    """The embedded cluster's dashboard (loopback, no authentication) answers any local
    user; a page Dask fails to make (``/sitemap.json``) had tornado print its traceback
    in the run's stderr, so anyone could write tracebacks into a run's output at will.
    They get the error page; the run prints nothing."""
    root = os.path.dirname(os.path.dirname(__file__))
    done = subprocess.run([sys.executable, "-c", DASHBOARD_REQUEST], cwd=root,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0 and "answered 500" in done.stdout, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and "Uncaught" not in done.stderr, done.stderr


def test_reliability_page_names_these_tests():
    """docs/reliability.md's section lists this module's attacks by their tests."""
    page = os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "reliability.md")
    section = open(page, encoding="utf-8").read().split("## Other users of the machine", 1)[1]
    section = section.split("\n## ", 1)[0]
    named = {name for line in section.splitlines() if line.startswith("| ")
             for name in re.findall(r"`(test_\w+)`", line.rsplit("|", 2)[-2])}
    tests = {name for name in globals()
             if name.startswith("test_") and name != "test_reliability_page_names_these_tests"}
    assert named == tests
