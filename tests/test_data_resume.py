"""A run's dataset store against what its checkpoints trained on.

The same `data.*` settings can give another store: an image folder with an image
added, removed or replaced is imported again into the same path. A resume then went
on training the checkpointed weights on the new images, its record saying nothing.
Now the checkpoints record the store's content identity (a digest of its chunk
checksums) and a resume on other images is refused in one line; a store rebuilt to
the same bytes (the files touched, the folder restored) resumes. And a store rebuilt
in place by another run while this one reads it stops this one, rather than mixing
the two stores' images in one run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import xarray as xr
from PIL import Image

from storage import checkpoints
from storage.datasets import (DatasetChanged, DatasetError, clear_read_cache, ensure_dataset,
                              open_dataset_info, read_batch, read_labels)
from tests.helpers import assert_one_error_line, run_main
from tests.test_image_folder import ROOT, _train_args, make_folder


def _resume_args(tmp_path, source: str, store, steps: int, *extra: str) -> list[str]:
    return _train_args(tmp_path, f"data.source={source}", f"data.path={store}",
                       "data.image_size=16", "network.classes=3", "train.checkpoint_every=2",
                       f"train.steps={steps}", *extra)


def test_a_resume_on_a_changed_image_folder_is_refused(tmp_path):
    source = make_folder(tmp_path / "pets")
    store = tmp_path / "pets.zarr"
    status, lines, _ = run_main("train", _resume_args(tmp_path, source, store, 2))
    assert status == 0, lines
    identity = open_dataset_info(str(store)).identity
    made = checkpoints.made_with(str(tmp_path / "run" / "checkpoints.zarr"))
    assert made["dataset"]["identity"] == identity and identity

    # every file touched: the store is rebuilt, to the same bytes, and the run resumes
    for directory, _, files in os.walk(source):
        for name in files:
            os.utime(os.path.join(directory, name), ns=(10**18, 10**18))
    status, lines, _ = run_main("train", _resume_args(tmp_path, source, store, 4,
                                                      "train.resume=true"))
    assert status == 0, lines
    assert open_dataset_info(str(store)).identity == identity
    record = tmp_path / "run" / "record.zarr"
    assert xr.open_zarr(record).sizes["step"] == 4

    # an image added: the store is rebuilt with it, and the resume is refused
    added = os.path.join(source, "dog", "new.png")
    Image.fromarray(np.full((20, 20, 3), 7, dtype=np.uint8)).save(added)
    status, lines, _ = run_main("train", _resume_args(tmp_path, source, store, 6,
                                                      "train.resume=true"))
    rebuilt = f"dataset: building {store} again in its place: its source files changed"
    assert lines[0] == rebuilt, lines  # said as it happens, before the refusal
    assert_one_error_line(status, lines[1:], 2, "train.resume: the checkpoints in ")
    assert f"the dataset store {store} holds other images" in lines[1], lines
    assert "15/3 train/test images then, 16/3 now" in lines[1], lines
    assert xr.open_zarr(record).sizes["step"] == 4  # nothing trained

    # an image replaced by another of the same name: the counts stay, still refused
    os.remove(added)
    replaced = os.path.join(source, "cat", "00.png")
    Image.fromarray(np.full((20, 28, 3), 200, dtype=np.uint8)).save(replaced)
    status, lines, _ = run_main("train", _resume_args(tmp_path, source, store, 6,
                                                      "train.resume=true"))
    assert lines[0] == rebuilt, lines
    assert_one_error_line(status, lines[1:], 2, "15/3 train/test images then, 15/3 now")

    # the folder as it was: the resume goes on
    shutil.rmtree(source)
    make_folder(tmp_path / "pets")
    status, lines, _ = run_main("train", _resume_args(tmp_path, source, store, 6,
                                                      "train.resume=true"))
    assert status == 0, lines
    assert xr.open_zarr(record).sizes["step"] == 6


def test_a_reader_pinned_to_a_store_refuses_it_rebuilt_with_other_images(tmp_path):
    store = str(tmp_path / "s.zarr")
    info = ensure_dataset("synthetic", store, train_samples=8, test_samples=2, seed=0)
    rows = np.arange(4)
    before = read_batch(store, "train", rows, info.identity)[0]
    # rebuilt from the same request: the same bytes, read on
    ensure_dataset("synthetic", store, train_samples=8, test_samples=2, seed=0,
                   overwrite=True)
    assert np.array_equal(read_batch(store, "train", rows, info.identity)[0], before)
    ensure_dataset("synthetic", store, train_samples=8, test_samples=2, seed=1)
    with pytest.raises(DatasetChanged, match=f"dataset store {store} was rebuilt with other"):
        read_batch(store, "train", rows, info.identity)
    with pytest.raises(DatasetChanged):
        read_labels(store, "train", rows, info.identity)
    assert not np.array_equal(read_batch(store, "train", rows)[0], before)  # unpinned


def test_a_reader_pinned_to_a_store_refuses_it_removed_or_half_rebuilt(tmp_path):
    """A rebuild in place removes the store first: a pinned reader that comes between
    (the metadata gone, or an array not written yet) is told the store it started on
    went away, not that the path is no dataset store; an unpinned one is told that."""
    store = str(tmp_path / "s.zarr")
    info = ensure_dataset("synthetic", store, train_samples=8, test_samples=2, seed=0)
    rows = np.arange(4)
    read_batch(store, "train", rows, info.identity)
    shutil.rmtree(os.path.join(store, "train", "labels"))  # half written, the metadata there
    clear_read_cache()
    with pytest.raises(DatasetChanged, match=f"dataset store {store} was removed or is being "
                       "rebuilt while this run read it"):
        read_batch(store, "train", rows, info.identity)
    shutil.rmtree(store)
    with pytest.raises(DatasetChanged, match="was removed or is being rebuilt"):
        read_labels(store, "train", rows, info.identity)
    with pytest.raises(DatasetError) as unpinned:
        read_batch(store, "train", rows)
    assert not isinstance(unpinned.value, DatasetChanged)


def test_a_run_whose_store_is_rebuilt_under_it_stops_in_one_line(tmp_path):
    """Another run at the same `data.path` with other data rebuilds the store in place
    while this one trains: the workers read the new images from then on, with nothing
    said. Now the run's reads are pinned to the store it started on: it stops, exit 1,
    one line naming the store, and no worker's "Compute Failed" block."""
    store = str(tmp_path / "s.zarr")
    counts = {"train_samples": 256, "test_samples": 32}
    ensure_dataset("synthetic", store, seed=0, **counts)
    output = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline.train", os.path.join(ROOT, "configs", "small.yaml"),
         f"output={output}", "progress=false", "prediction=never", f"data.path={store}",
         "placement=even",  # not about placement: calibrating costs the run seconds
         "data.train_samples=256", "data.test_samples=32", "train.steps=1000000",
         "train.batch=8", "train.checkpoint_every=2", "network.conv.0.kernels=4",
         "network.conv.1.kernels=4"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        path = str(output / "checkpoints.zarr")
        while not (os.path.exists(path) and checkpoints.complete_steps(path)[-1:] >= [4]):
            assert process.poll() is None and time.monotonic() < deadline, \
                process.communicate(timeout=60)
            time.sleep(0.1)
        ensure_dataset("synthetic", store, seed=1, **counts)  # another run's data
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert process.returncode == 1, err
    assert len(errors) == 1, err  # read after the rebuild, or while it was under way
    assert f"dataset store {store} was rebuilt with other images" in errors[0] or \
        f"dataset store {store} was removed or is being rebuilt" in errors[0], err
    assert "Compute Failed" not in err and "Traceback" not in err, err


def test_a_store_rebuilt_before_the_test_images_are_read_loses_only_the_score(
        tmp_path, tiny_dataset_factory, monkeypatch, capsys):
    """The steps are done when the run reads the test images for its score; a store
    rebuilt with other images by then (or damaged, or gone) stopped the run before it
    wrote its record and summary. Now they are written, without the score, and the
    record's notes and a warning line say why."""
    import json

    import pipeline.training.evaluate as evaluate
    from pipeline.run import run_training
    from tests.test_integrity import reference_config

    def rebuilt(*args, **kwargs):
        raise DatasetChanged("dataset store X was rebuilt with other images")
    monkeypatch.setattr(evaluate, "read_batch", rebuilt)
    config = reference_config(tmp_path, tiny_dataset_factory("float32"),
                              **{"train.steps": 2, "train.eval_samples": 16})
    result = run_training(config)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert result.summary["test_accuracy"] is None and summary["test_accuracy"] is None
    assert summary["recorded_steps"] == 2
    notes = json.loads(xr.open_zarr(tmp_path / "run" / "record.zarr").attrs["notes"])
    assert any(note.startswith("warning: test accuracy none: dataset store X was rebuilt")
               for note in notes), notes
    assert "warning: test accuracy none: dataset store X" in capsys.readouterr().err
