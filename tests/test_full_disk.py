"""A full disk, for real: a run and a sweep writing onto a small tmpfs that fills.

Each stops with one line naming the store whose disk is full and its path, what was
kept and how to go on, exit 1, no Dask "Compute Failed" block or traceback; what
was written before stays readable (the last complete checkpoint passes its
checksums; the sweep store opens without a warning, its finished points intact,
and the same command, run again with room, runs only the rest). The commands run
through their `main` in the test's process (what `python -m` runs, one interpreter
start less each); as processes they are tests/test_signals.py's and
tests/test_faults.py's. Mounting needs root: without it those tests are skipped with
the reason. The helpers around
(`NoSpace`, `writing`, the workers' log filter) are checked everywhere.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import shlex
import shutil
import subprocess
import warnings

import pytest
import xarray as xr

from experiments.sweep.store_layout import DONE
from storage import checkpoints
from storage.space import NoSpace, is_full, replace_file, writing
from tasks.worker_state import _DropEndedRunFailures
from tests.helpers import error_lines_of, run_main, scheduler_args
from tests.test_cli import tiny_args
from tests.test_faults import FAULTS
from tests.test_sweep import write_sweep


def mount_problem() -> str | None:
    """Why a tmpfs cannot be mounted here, or None."""
    if os.geteuid() != 0:
        return "mounting a small tmpfs needs root"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "needs mount and umount"
    return None


PROBLEM = mount_problem()
needs_mount = pytest.mark.skipif(PROBLEM is not None, reason=f"a full disk: {PROBLEM}")


@pytest.fixture
def small_disk(tmp_path):
    """`mount(size)`: a tmpfs of `size` (tmpfs units: 400k, 2m) at tmp_path/disk, or
    a bigger one over it again; unmounted at the end."""
    target = tmp_path / "disk"
    target.mkdir()
    mounted: list[bool] = []

    def mount(size: str):
        if os.geteuid() != 0:  # only root mounts; as root a failed mount is a failure
            pytest.skip(f"a full disk: mounting a tmpfs needs root (uid {os.geteuid()})")
        options = f"remount,size={size}" if mounted else f"size={size},mode=0755"
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
                              capture_output=True, text=True)
        assert done.returncode == 0, f"cannot mount a tmpfs as root: {done.stderr.strip()}"
        mounted.append(True)
        return target

    yield mount
    if mounted:
        if subprocess.run(["umount", str(target)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(target)], capture_output=True)


# Without root ---------------------------------------------------------------------


def test_a_full_disk_becomes_one_error_naming_the_store(tmp_path):
    """`writing` turns ENOSPC (also wrapped) into `NoSpace` naming the store and path,
    passes any other error, and a `NoSpace` survives pickling (it crosses from a
    worker to the client) with its store and path."""
    def full() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(NoSpace) as raised:
        with writing("checkpoint store", str(tmp_path / "c.zarr")):
            full()
    error = raised.value
    assert (error.store, error.path, error.errno) == ("checkpoint store",
                                                      str(tmp_path / "c.zarr"), errno.ENOSPC)
    assert str(error).startswith(f"no space left on the disk holding the checkpoint store "
                                 f"{tmp_path / 'c.zarr'} (") and "free of" in str(error)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is NoSpace and (again.store, again.path, str(again)) == (
        error.store, error.path, str(error))
    with pytest.raises(NoSpace, match="workspace"):  # the inner, more precise store wins
        with writing("output directory", "/out"), writing("workspace", "/ws"):
            full()
    try:
        try:
            full()
        except OSError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert is_full(outer)
    with pytest.raises(PermissionError):
        with writing("output directory", "/out"):
            raise PermissionError(errno.EACCES, "no")
    assert not is_full(PermissionError(errno.EACCES, "no"))


def test_replace_file_leaves_the_old_file_when_a_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    replace_file(str(path), "old")

    def refuse(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError):
        replace_file(str(path), "new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["summary.json"]


def test_workers_do_not_log_a_full_disk_the_client_reports():
    """The "Compute Failed" block a worker logs for a failed task is dropped for
    `NoSpace` (the run says it in one line) and kept for an ordinary failure."""
    def record(exception_text: str) -> logging.LogRecord:
        return logging.LogRecord(
            "distributed.worker", logging.ERROR, __file__, 1,
            "Compute Failed\nKey: %s\nState: %s\nTask: %s\nException: %r\nTraceback: %r\n",
            ("save-5-w0", "executing", "<Task save_run(...)>", exception_text, "..."), None)

    drop = _DropEndedRunFailures()
    error = NoSpace("checkpoint store", "/x/checkpoints.zarr", "0 B free of 400 KiB")
    assert not drop.filter(record(repr(error)))
    assert drop.filter(record("ValueError('a real bug')"))


# On a real tmpfs (root) -------------------------------------------------------------


@needs_mount
def test_a_run_on_a_full_disk_stops_with_one_line_and_keeps_its_checkpoints(
        small_disk, tiny_dataset_factory, shared_cluster):
    """A run on the session's cluster (`--scheduler`: its workers write the
    checkpoints) into a 400 KiB tmpfs, a checkpoint every 2 steps: the disk fills
    while the workers save one."""
    assert FAULTS["disk full mid-run (checkpoints on a small tmpfs)"] == "clean"
    disk = small_disk("400k")
    client, _ = shared_cluster
    out = disk / "run"
    args = [*tiny_args(disk, tiny_dataset_factory("float32")), "--fresh", "placement=even",
            "train.steps=60", "train.checkpoint_every=2", "train.eval_samples=0",
            *scheduler_args(client, str(disk.parent))]
    status, said, _out = run_main("train", args)  # its main, in this process (module doc)
    stderr = "\n".join(said)
    lines = error_lines_of(stderr)
    assert status == 1 and len(lines) == 1, stderr
    path = str(out / "checkpoints.zarr")
    last, passed = checkpoints.latest_valid_step(path)  # and every tensor matches its sum
    assert last is not None and not passed
    assert lines[0].startswith(f"error: no space left on the disk holding the checkpoint "
                               f"store {path} ("), lines[0]
    assert f"kept: every complete checkpoint, the last at step {last} ({path})" in lines[0]
    command = shlex.split(lines[0].split(" with: ", 1)[1])
    assert command[-1] == "train.resume=true" and "--fresh" not in command
    assert "Compute Failed" not in stderr and "Traceback" not in stderr
    assert not [name for name in os.listdir(out) if name.endswith(".partial")]


@needs_mount
def test_a_sweep_on_a_full_disk_stops_with_one_line_and_the_rest_runs_later(
        small_disk, tiny_dataset_factory, capsys):
    """Four plain-PyTorch points, the store and the runs on a 1 MiB tmpfs: the disk
    fills during a point; the sweep stops there, the point left pending. Run again
    with room, only the rest run, and the finished points are untouched."""
    assert FAULTS["disk full mid-sweep, then run again with room"] == "clean"
    disk = small_disk("1m")
    store = str(disk / "full.zarr")
    config = write_sweep(disk.parent, tiny_dataset_factory("float32"),
                         {"train.lr": [0.01, 0.02, 0.03, 0.04]}, name="full",
                         base={"strategy": "reference"})
    status, err, out = run_main("sweep", [config, "--out", store])  # in this process
    stderr = "\n".join(err)
    lines = [line for line in error_lines_of(stderr) if "point/s" not in line]  # no tqdm bar
    said = f"exit {status}\n{out}\n{stderr}"
    assert status == 1 and len(lines) == 1, said
    assert lines[0].startswith("error: no space left on the disk holding the "), said
    assert str(disk) in lines[0] and "Traceback" not in stderr, said
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # opens cleanly: consolidated, nothing half-written
        before = xr.open_zarr(store).load()
    done = int((before.status == DONE).sum())
    assert 1 <= done < 4 and f"kept: {done} of 4 point(s) finished, in {store}" in lines[0], \
        (said, before.status.values)
    assert int((before.status == 0).sum()) == 4 - done, said  # the rest pending, none failed

    small_disk("16m")  # room again: the same command runs only the rest
    assert run_main("sweep", [config, "--out", store])[0] == 0
    after = xr.open_zarr(store).load()
    assert (after.status == DONE).all()
    finished = before.status.values == DONE
    for name in ("run_id", "step_time", "loss"):
        assert (after[name].values[finished] == before[name].values[finished]).all(), name
    capsys.readouterr()
