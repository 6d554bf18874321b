"""The exchange workspace: single-chunk slots, ready markers, abort (no cluster)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zarr

from storage.arrays import ArrayLayout, create_array, create_arrays
from storage.exchange import Exchange, ExchangeError, SlotSpec, _chunk_file, create_exchange
from storage.exchange_folders import remove_exchange, remove_own_exchanges, write_owner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture()
def workspace(tmp_path):
    path = str(tmp_path / "run.zarr")
    create_exchange(path, [SlotSpec("act/0/1", (4, 3, 2, 2), "float32"),
                           SlotSpec("grad/1", (2, 5), "float64")])
    return path


def test_arrays_made_at_once_are_those_made_one_by_one(tmp_path):
    """`create_arrays` (one concurrent write of metadata) makes what `create_array` makes,
    replaces an array's chunks as it does, and keeps the attributes of groups above."""
    root = zarr.open_group(str(tmp_path / "a.zarr"), mode="w")
    root.attrs["made_for"] = "kept"
    group = root.require_group("step/0000004")
    group.attrs["complete"] = False
    old = create_array(group, "weights/conv.0", (6, 3), (2, 3), "float64")
    old[...] = 7.0
    layouts = {"weights/conv.0": ArrayLayout((6, 3), (2, 3), "float64"),
               "momentum/conv.0": ArrayLayout((5,), (5,), "float32"),
               "act/0/1": ArrayLayout((2, 3, 4, 4), (2, 3, 4, 4), "int64")}
    create_arrays(group, layouts)
    alone = create_array(zarr.open_group(str(tmp_path / "b.zarr"), mode="w"), "x",
                         (5,), (5,), "float32")
    for name, layout in layouts.items():
        array = zarr.open_array(str(tmp_path / "a.zarr"), path=f"step/0000004/{name}")
        assert (array.shape, array.chunks, str(array.dtype)) == tuple(layout)
        np.testing.assert_array_equal(array[...], np.zeros(layout.shape))  # old chunks gone
    made = zarr.open_array(str(tmp_path / "a.zarr"), path="step/0000004/momentum/conv.0")
    assert made.metadata.to_dict() == alone.metadata.to_dict()
    reopened = zarr.open_group(str(tmp_path / "a.zarr"), mode="r")
    assert reopened.attrs["made_for"] == "kept"
    assert reopened["step/0000004"].attrs["complete"] is False


def test_written_slot_reads_back_and_is_a_plain_zarr_array(workspace):
    exchange = Exchange(workspace)
    data = np.random.default_rng(0).standard_normal((4, 3, 2, 2)).astype("float32")
    exchange.write("act/0/1", 7, data)
    exchange.wait("act/0/1", 7, timeout=1)
    np.testing.assert_array_equal(exchange.read("act/0/1"), data)
    # the fast path wrote the chunk Zarr itself reads
    assert _chunk_file(exchange.data, "act/0/1") is not None
    np.testing.assert_array_equal(zarr.open_array(exchange.data, path="act/0/1")[...], data)
    grad = np.arange(10, dtype="float64").reshape(2, 5)
    exchange.write("grad/1", 7, grad)
    np.testing.assert_array_equal(zarr.open_array(exchange.data, path="grad/1")[...], grad)


def test_fast_path_refuses_a_shape_it_was_not_made_for(workspace):
    with pytest.raises(ValueError, match="shape"):
        Exchange(workspace).write("act/0/1", 0, np.zeros((4, 3, 2, 3), "float32"))


def test_reader_waits_for_the_writer(workspace):
    exchange = Exchange(workspace)
    data = np.ones((2, 5))
    writer = threading.Timer(0.2, lambda: Exchange(workspace).write("grad/1", 3, data))
    writer.start()
    started = time.monotonic()
    exchange.wait("grad/1", 3, timeout=5)
    waited = time.monotonic() - started
    writer.join()
    assert 0.15 < waited < 2.0
    np.testing.assert_array_equal(exchange.read("grad/1"), data)


def test_a_reader_behind_its_writer_reports_the_broken_order(workspace):
    exchange = Exchange(workspace)
    exchange.write("grad/1", 5, np.zeros((2, 5)))
    with pytest.raises(ExchangeError, match="already at step 5"):
        exchange.wait("grad/1", 4, timeout=1)


def test_abort_ends_a_wait_with_the_clients_reason(workspace):
    exchange = Exchange(workspace)
    threading.Timer(0.1, lambda: Exchange(workspace).abort("worker w1 left")).start()
    with pytest.raises(ExchangeError, match="worker w1 left"):
        exchange.wait("act/0/1", 0, timeout=30)


def test_wait_times_out_naming_the_slot(tmp_path):
    path = str(tmp_path / "lonely.zarr")
    create_exchange(path, [SlotSpec("act/0/1", (1,), "float32")])
    with pytest.raises(ExchangeError, match="act/0/1 of step 2.*wait_timeout"):
        Exchange(path).wait("act/0/1", 2, timeout=0.3)


def test_cancelled_task_stops_waiting(workspace):
    with pytest.raises(ExchangeError, match="cancelled"):
        Exchange(workspace).wait("act/0/1", 0, timeout=30, cancelled=lambda: True)


def test_remove_exchange(workspace):
    remove_exchange(workspace)
    assert not os.path.exists(workspace)


def test_a_process_stopped_at_once_removes_its_workspaces_and_an_emptied_root(tmp_path):
    """What a second stop signal removes (`remove_own_exchanges`): this process's
    workspaces, then their root if that leaves it empty; another process's workspace
    stays, and keeps the root."""
    root = tmp_path / "dask-cnn-root"
    own = [str(root / f"own-{i}.zarr") for i in range(2)]
    for folder in own:
        write_owner(folder)
    remove_own_exchanges(str(root))
    assert not root.exists()
    other = root / "other.zarr"
    other.mkdir(parents=True)
    (other / "owner.json").write_text(json.dumps({"kind": "hetcnn-workspace", "pid": 1,
                                                  "host": "elsewhere"}))
    write_owner(own[0])
    remove_own_exchanges(str(root))
    assert sorted(os.listdir(root)) == ["other.zarr"]


def test_a_late_writer_does_not_keep_a_removed_workspace_alive(tmp_path):
    """A fenced-off worker woken while its run removes the workspace goes on marking
    slots ready: none of its writes survives the removal, nor makes the folder again
    (seen as a leftover `ready/act.0.1` in tests/test_link_faults.py)."""
    for attempt in range(5):
        path = str(tmp_path / f"run{attempt}.zarr")
        create_exchange(path, [SlotSpec("act/0/1", (1,), "float32")])
        for n in range(200):  # a full folder: removing it takes a while
            Exchange(path).markers.set(f"act/0/{n}", 1)
        late, stop = Exchange(path), threading.Event()

        def mark() -> None:
            while not stop.is_set():
                try:
                    late.markers.set("act/0/1", 2)
                except OSError:  # its folder is gone: what a late writer then meets
                    pass

        writer = threading.Thread(target=mark)
        writer.start()
        time.sleep(0.01)
        remove_exchange(path)
        stop.set()
        writer.join()
        assert not os.path.exists(path), os.listdir(tmp_path)
        assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_closed_says_when_the_client_ended_the_run(tmp_path, where):
    """A worker woken after its run ended learns it from the workspace: aborted, or
    gone (the client removes it when it closes the run)."""
    path = str(tmp_path / "ws.zarr") if where == "local" else f"memory://{tmp_path.name}/ws.zarr"
    create_exchange(path, [SlotSpec("a", (2,), "float32")])
    exchange = Exchange(path)
    assert exchange.closed() is None
    exchange.abort("the run is closing")
    assert exchange.closed() == "the run is closing"
    remove_exchange(path)
    assert exchange.closed() == "the run's workspace is gone"


def test_arrays_made_on_a_full_disk_fail_once_with_every_write_heard(tmp_path):
    """A disk that fills while many arrays are made: one error, the disk's, and no
    write's failure left unretrieved, which asyncio prints as a traceback each when
    the process ends (a full disk under a checkpoint printed dozens). In a process
    of its own, which must end for those to show."""
    script = f"""
import errno, zarr
from zarr.storage import LocalStore
from storage.arrays import ArrayLayout, create_arrays

class FullDisk(LocalStore):
    async def set(self, key, value, *args, **kwargs):
        if key.startswith("step/"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return await super().set(key, value, *args, **kwargs)

group = zarr.open_group(store=FullDisk({str(tmp_path / "a.zarr")!r}), mode="w")
try:
    create_arrays(group, {{f"step/{{i}}": ArrayLayout((4,), (4,), "float32") for i in range(40)}})
except OSError as error:
    print("raised", error.errno == errno.ENOSPC)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.stdout.strip() == "raised True", done.stdout + done.stderr
    assert done.stderr == "", done.stderr
