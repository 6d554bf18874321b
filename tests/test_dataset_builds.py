"""Builds of one dataset store by several processes, and builds killed half-way.

Two runs that found no store at one path built it both, the second deleting the
first's finished store under it (whose run was already reading it) before renaming
its own in; a build killed (SIGKILL, an OOM kill) left its half-written temporary
store beside the path for good, a CIFAR-10 import's up to 739 MB. Now one process at
a time decides, builds or checks the store at a path (an flock beside it): a second
waits, saying so in one line, and reuses what the first built; the holder removes
what killed builds left.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Iterator

import pytest

from storage.datasets import ensure_dataset
from tests.test_image_folder import ROOT

HOLDER = """
import os, sys
from storage.datasets import ensure_dataset
from storage.datasets.writer import build_lock
path = sys.argv[1]
with build_lock(path):
    print("ready", flush=True)
    sys.stdin.readline()
    ensure_dataset("synthetic", path, train_samples=8, test_samples=2, seed=0)
    print(os.stat(os.path.join(path, "zarr.json")).st_ino, flush=True)
"""


@pytest.fixture
def memory_folder(tmp_path) -> Iterator[str]:
    """A private folder on tmpfs (/dev/shm), removed after; `tmp_path` where there is none."""
    if not os.path.isdir("/dev/shm"):
        yield str(tmp_path)
        return
    folder = tempfile.mkdtemp(prefix="hetcnn-test-lock-", dir="/dev/shm")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _leftovers(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if ".building-" in name)


def test_a_second_build_of_one_store_waits_and_reuses_it(tmp_path):
    store = str(tmp_path / "s.zarr")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, store], cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    said: list[str] = []
    got: list[object] = []
    try:
        assert holder.stdout.readline().strip() == "ready"
        second = threading.Thread(target=lambda: got.append(ensure_dataset(
            "synthetic", store, train_samples=8, test_samples=2, seed=0, say=said.append)))
        second.start()
        deadline = time.monotonic() + 60
        while not said:  # the second build names the first's holder, then waits
            assert time.monotonic() < deadline and second.is_alive(), (said, got)
            time.sleep(0.05)
        assert not got and not os.path.exists(store)
        assert said[0].startswith(f"waiting for another build to finish with dataset store "
                                  f"{store} (pid {holder.pid} on "), said
        holder.stdin.write("\n")
        holder.stdin.flush()
        built = int(holder.stdout.readline())
        holder.stdin.close()
        holder.wait(timeout=60)
        second.join(timeout=60)
        assert not second.is_alive()
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(timeout=60)
    assert holder.returncode == 0 and len(got) == 1 and len(said) == 1, said
    assert os.stat(os.path.join(store, "zarr.json")).st_ino == built  # reused, not rebuilt
    assert not os.path.exists(tmp_path / ".s.zarr.lock") and not _leftovers(tmp_path)


#: A build that stops once its arrays are written, before their checksums and the
#: rename: killed there, it leaves its half-written store behind, whatever the load
#: (polling for the store from outside raced the build's last tens of milliseconds).
STOPPED_BUILD = """
import sys, time
from storage.datasets import ensure_dataset, writer
def stopped(folder):
    print("written", flush=True)
    time.sleep(600)
writer.record_checksums = stopped
ensure_dataset("synthetic", sys.argv[1], train_samples=64, test_samples=16)
"""


def test_a_killed_builds_half_written_store_is_removed_by_the_next(tmp_path):
    store = str(tmp_path / "s.zarr")
    build = subprocess.Popen([sys.executable, "-c", STOPPED_BUILD, store], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert build.stdout.readline() == "written\n"
    finally:
        build.send_signal(signal.SIGKILL)
        build.wait(timeout=60)
        build.stdout.close()
    left = _leftovers(tmp_path)
    assert len(left) == 1 and not os.path.exists(store)
    said: list[str] = []
    info = ensure_dataset("synthetic", store, train_samples=8, test_samples=2, say=said.append)
    assert info.train_samples == 8 and not _leftovers(tmp_path)
    assert said == [f"note: removed {tmp_path / left[0]}, a dataset store a killed build "
                    "left half-written"]


def test_a_dataset_lock_file_planted_as_a_link_stops_the_run_in_one_line(tmp_path, capsys,
                                                                        monkeypatch):
    """A symbolic link where a dataset store's build lock goes (``.<name>.lock`` beside
    it): the lock refuses it, and the run says so in one line, exit 3, as it says a
    run's or a sweep's lock file refused (it stopped with a bare LockBusy traceback)."""
    from pipeline import train
    from pipeline.cli import IN_USE
    from tests.helpers import error_lines_of
    monkeypatch.setenv("CNN_MEMORY_RUNTIME", "fitted")
    target = tmp_path / "precious.txt"
    target.write_text("the user's own file\n")
    (tmp_path / ".s.zarr.lock").symlink_to(target)
    config = os.path.join(ROOT, "configs", "small.yaml")
    assert train.main([config, "strategy=reference", "train.steps=1", "train.eval_samples=0",
                       "data.train_samples=64", "data.test_samples=8",
                       f"data.path={tmp_path / 's.zarr'}", f"output={tmp_path / 'run'}",
                       "prediction=never"]) == IN_USE
    lines = error_lines_of(capsys.readouterr().err)
    assert len(lines) == 1 and "is a symbolic link" in lines[0], lines
    assert target.read_text() == "the user's own file\n"


def test_a_lock_released_while_another_opens_it_is_waited_for_not_refused(memory_folder):
    """Builds contending for one store's lock: the holder's release removes the lock
    file, and a contender that opened it just before saw a file with no name left
    (st_nlink 0), which the lock took for a hard link and refused ('has another name
    too'), stopping a run that only had to wait. Threads stand for the processes
    (flock is per open file). Bounded: a fixed number of tries, joined with a timeout.
    In memory (`memory_folder`): each take of the lock fsyncs its record, 25 s of the
    16,000 on disk, 1-2 s on tmpfs, where the faster turns also meet the race more
    often (without the fix: 150-580 refusals in 16,000 here, against 37 on disk)."""
    from storage.locks import LockBusy, OwnerLock
    path = os.path.join(memory_folder, ".s.zarr.lock")
    refused: list[str] = []

    def contend() -> None:
        for _ in range(4000):
            lock = OwnerLock(path, "dataset store s.zarr", "another build")
            try:
                lock.acquire(on_wait=lambda line: None)
            except LockBusy as error:
                refused.append(str(error))
                continue
            lock.release()
    threads = [threading.Thread(target=contend, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert not refused, refused[:1]
