"""Checkpoint fencing (storage/checkpoints.py): a worker of an attempt that ended (a
stalled worker fenced off, woken inside a save) can land its rows only in that
attempt's staging area, never in a checkpoint the live run reads. Pure storage: the
late write is made directly, at the worst moment (after the live attempt committed
the same step), which a real SIGSTOP hits only by chance (tests/test_stalls.py). And
a listing that meets a metadata file Zarr is writing stays quiet and counts right."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import zarr

from storage import checkpoints

SHAPES = {"0.weight": (8, 3), "0.bias": (8,)}
CHUNKS = {"0.weight": 4, "0.bias": 4}


def _fresh(tmp_path) -> str:
    path = str(tmp_path / "checkpoints.zarr")
    checkpoints.start_fresh(path, "net")
    return path


def _write_all(root: str, step: int, value: float) -> None:
    for kind in checkpoints.KINDS:
        for key, shape in SHAPES.items():
            checkpoints.write_slice(root, step, kind, key, 0, np.full(shape, value))


def test_a_late_write_of_an_ended_attempt_never_reaches_the_checkpoint(tmp_path):
    """Attempt A stages step 8 and ends before committing it (its worker stalled, with
    its write under way); attempt B writes and commits step 8; A's worker wakes and
    writes its rows. Step 8 keeps B's values and checksums, and the late write is
    found and discarded (counted for A), with nothing left of either staging area."""
    path = _fresh(tmp_path)
    staged_a = checkpoints.stage_checkpoint(path, "run-a", 8, SHAPES, CHUNKS, "float64")
    zombie = zarr.open_array(staged_a, path=f"{checkpoints.step_group(8)}/weights/0.weight",
                             mode="r+")  # a write under way: its array is open
    zombie[0:4] = 7.0
    checkpoints.end_attempt(path, "run-a")  # the engine closed after the stall
    staged_b = checkpoints.stage_checkpoint(path, "run-b", 8, SHAPES, CHUNKS, "float64")
    _write_all(staged_b, 8, 1.0)
    checkpoints.mark_complete(path, 8, {"step": 8}, attempt="run-b")
    assert checkpoints.complete_steps(path) == [8]

    # the zombie resumes where it stopped: in the middle of its write to its own area;
    # a write it starts afresh finds its area gone
    zombie[4:8] = 7.0
    with pytest.raises(FileNotFoundError):
        checkpoints.write_slice(staged_a, 8, "momentum", "0.bias", 0, np.full((8,), 7.0))

    assert checkpoints.damage(path, 8) is None
    assert all((checkpoints.read_tensors(path, 8, kind)[key] == 1.0).all()
               for kind in checkpoints.KINDS for key in SHAPES)
    checkpoints.end_attempt(path, "run-b")  # the run ends
    assert checkpoints.discard_attempts(path) == {"run-a": 1}
    assert os.listdir(os.path.join(path, checkpoints.ATTEMPTS)) == ["zarr.json"]
    assert checkpoints.discard_attempts(path) == {}
    assert checkpoints.store_of(staged_a) == path == checkpoints.store_of(path)
    assert checkpoints.store_of("/runs/attempt/checkpoints.zarr").endswith("checkpoints.zarr")


def test_a_commit_replaces_an_older_copy_of_its_step(tmp_path):
    """A step present but damaged (or incomplete, from a store of before staging) is
    replaced whole by the commit; a step is never half old, half new."""
    path = _fresh(tmp_path)
    checkpoints.create_checkpoint(path, 4, SHAPES, CHUNKS, "float64")  # in place, incomplete
    _write_all(path, 4, 3.0)
    staged = checkpoints.stage_checkpoint(path, "run-c", 4, SHAPES, CHUNKS, "float64")
    checkpoints.write_slice(staged, 4, "weights", "0.weight", 0, np.full((8, 3), 2.0))
    checkpoints.mark_complete(path, 4, {"step": 4}, attempt="run-c")
    weights = checkpoints.read_tensors(path, 4)
    assert (weights["0.weight"] == 2.0).all() and (weights["0.bias"] == 0.0).all()
    assert checkpoints.latest_valid_step(path) == (4, [])
    assert not os.path.exists(os.path.join(checkpoints.staging_root(path, "run-c"), "step",
                                           "0000004"))


def test_listing_while_zarr_writes_a_metadata_file_neither_warns_nor_miscounts(tmp_path):
    """Zarr writes each metadata file as NAME.<hex>.partial, then renames it. A reader
    listing the checkpoints then (a run's watcher, a resume) meets that file: it is
    no checkpoint, and no warning is printed for it."""
    path = _fresh(tmp_path)
    staged = checkpoints.stage_checkpoint(path, "run-a", 4, SHAPES, CHUNKS, "float64")
    _write_all(staged, 4, 1.0)
    checkpoints.mark_complete(path, 4, {"step": 4}, attempt="run-a")
    with open(os.path.join(path, "step", "zarr.0123456789abcdef.partial"), "w") as handle:
        handle.write("{")  # as a writer caught between its write and its rename
    with pytest.warns(UserWarning, match="not recognized"):  # Zarr's own listing warns
        list(zarr.open_group(path, mode="r")["step"].groups())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert checkpoints.complete_steps(path) == [4]
        assert checkpoints.latest_complete_step(path) == 4
    # a new step's folder before its zarr.json is written (seen in a resume test)
    os.remove(os.path.join(path, "step", "zarr.0123456789abcdef.partial"))
    os.makedirs(os.path.join(path, "step", "0000008"))
    with pytest.warns(UserWarning, match="Object at 0000008 is not recognized"):
        list(zarr.open_group(path, mode="r")["step"].groups())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert checkpoints.complete_steps(path) == [4]
