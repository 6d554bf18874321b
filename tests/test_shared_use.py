"""Another client's work on a scheduler the run shares (pipeline/cluster/shared_use.py):
said when it appears mid-run, not only when the run starts or ends."""

from __future__ import annotations

import json
import threading
import time

import xarray as xr

from storage import checkpoints
from tests.helpers import run_main, scheduler_args
from tests.test_cli import tiny_args


def test_another_clients_work_that_comes_mid_run_is_said_at_the_next_checkpoint(
        tmp_path, shared_cluster, tiny_dataset_factory):
    """A second run or sweep started after this one, on the same workers: it held no
    task as this run started, and it may be done before this run's steps end, so
    only a checkpoint in between sees it. Here the other client's task asks for a
    resource no worker has: it waits and slows nothing; it is cancelled once the run
    has said it. The run's checkpoint every 2 steps of 60: the task comes once some
    checkpoint is on disk, and the run says so at that checkpoint (where the task
    came before the run looked) or at a later one, in the record's notes too."""
    client, _ = shared_cluster
    out = tmp_path / "run"
    path = str(out / "checkpoints.zarr")
    came_at: list[int] = []
    stop = threading.Event()

    def come_mid_run() -> None:
        while not stop.is_set():
            reached = checkpoints.latest_complete_step(path) if (out / "checkpoints.zarr").exists() \
                else None
            if reached:
                came_at.append(reached)
                came_at.append(client.submit(sum, [1], resources={"NOWHERE": 1}, pure=False))
                return
            time.sleep(0.01)

    other = threading.Thread(target=come_mid_run, daemon=True)
    other.start()
    try:
        status, lines, _out = run_main("train", [
            *tiny_args(tmp_path, tiny_dataset_factory("float32")), "train.steps=60",
            "train.checkpoint_every=2", "train.eval_samples=0", "placement=even",
            *scheduler_args(client, str(tmp_path))])
    finally:
        stop.set()
        other.join()
        if len(came_at) == 2:
            client.cancel(came_at[1])
    assert status == 0, lines
    assert came_at and came_at[0] < 58, f"the other client's task came at {came_at}"
    said = [line for line in lines if "other client" in line]
    assert said[0].startswith("warning: at step "), lines
    at_step = int(said[0].split()[3].rstrip(","))
    assert came_at[0] <= at_step < 60 and at_step % 2 == 0, (came_at, said)
    assert said[0].endswith(
        f", 1 other client holds tasks on the Dask scheduler at {client.scheduler.address} "
        "(another run or sweep?): their work shares this run's workers, so its step "
        "times include it")
    assert said[1:] == [said[0].replace(f"at step {at_step}", "as its steps ended")]
    notes = json.loads(xr.open_zarr(out / "record.zarr").attrs["notes"])
    assert [note for note in notes if "other client" in note] == said
