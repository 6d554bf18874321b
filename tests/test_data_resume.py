"""A run's dataset store against what its checkpoints trained on.

The same `data.*` settings can give another store: an image folder with an image
added, removed or replaced is imported again into the same path. A resume then went
on training the checkpointed weights on the new images, its record saying nothing.
Now the checkpoints record the store's content identity (a digest of its chunk
checksums) and a resume on other images is refused in one line; a store rebuilt to
the same bytes (the files touched, the folder restored) resumes.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import xarray as xr
from PIL import Image

from storage import checkpoints
from storage.datasets import open_dataset_info
from tests.helpers import assert_one_error_line, run_main
from tests.test_image_folder import _train_args, make_folder


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
    assert_one_error_line(status, lines, 2, "train.resume: the checkpoints in ")
    assert f"the dataset store {store} holds other images" in lines[0], lines
    assert "15/3 train/test images then, 16/3 now" in lines[0], lines
    assert xr.open_zarr(record).sizes["step"] == 4  # nothing trained

    # an image replaced by another of the same name: the counts stay, still refused
    os.remove(added)
    replaced = os.path.join(source, "cat", "00.png")
    Image.fromarray(np.full((20, 28, 3), 200, dtype=np.uint8)).save(replaced)
    status, lines, _ = run_main("train", _resume_args(tmp_path, source, store, 6,
                                                      "train.resume=true"))
    assert_one_error_line(status, lines, 2, "15/3 train/test images then, 15/3 now")

    # the folder as it was: the resume goes on
    shutil.rmtree(source)
    make_folder(tmp_path / "pets")
    status, lines, _ = run_main("train", _resume_args(tmp_path, source, store, 6,
                                                      "train.resume=true"))
    assert status == 0, lines
    assert xr.open_zarr(record).sizes["step"] == 6
