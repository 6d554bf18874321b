"""Image folders (torchvision's ImageFolder layout) as datasets, and `data.image_size`.

The tests make small PNG and JPEG images of two sizes with Pillow, import them, and
check the store against Pillow's own resize and crop; then the refusals (a broken
file, too few classes, an empty class, a config whose classes or image size the
source does not have), each one line; then runs that train on an image folder and on
16x16 synthetic images, through the command line's main function in this process.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import xarray as xr
import zarr
from PIL import Image

from pipeline.config.run_config import build_run_config
from pipeline.config.schema import ConfigError
from storage.datasets import (DatasetError, ensure_dataset, import_image_folder,
                              list_image_folder, open_dataset_info, verify_dataset)
from tests.helpers import assert_one_error_line, run_main
from tests.test_datasets import small_shards  # noqa: F401 (autouse: several shards a store)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLASSES = ("cat", "dog", "emu")
PER_CLASS = 6
SIZES = ((20, 28), (44, 30))  # (width, height): a portrait and a landscape image


def _write_image(path, size: tuple[int, int], seed: int) -> None:
    """A random RGB image of `size` (width, height), PNG or JPEG by its extension."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def make_folder(root, classes=CLASSES, per_class: int = PER_CLASS) -> str:
    """`per_class` images a class, PNG and JPEG (one with an upper-case extension), of
    both `SIZES`, beside a text file and a hidden folder that are no images or class."""
    os.makedirs(root / ".cache", exist_ok=True)
    for label, name in enumerate(classes):
        folder = root / name
        folder.mkdir(parents=True)
        for index in range(per_class):
            extension = (".png", ".jpg", ".PNG")[index % 3]
            _write_image(folder / f"{index:02d}{extension}", SIZES[index % 2],
                         seed=100 * label + index)
        (folder / "notes.txt").write_text("not an image")
    return str(root)


def _stored(store: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    group = zarr.open_group(store, mode="r")
    return group[f"{split}/images"][:], group[f"{split}/labels"][:]


def _pillow_crop(path: str, resized: tuple[int, int], box: tuple[int, int, int, int]):
    """Pillow's resize and crop written out for one image: uint8 (3, side, side)."""
    with Image.open(path) as image:
        square = image.convert("RGB").resize(resized, Image.Resampling.BILINEAR).crop(box)
    return np.asarray(square).transpose(2, 0, 1)


# --- the import ------------------------------------------------------------------------


def test_import_holds_every_image_resized_labelled_and_checksummed(tmp_path):
    source = make_folder(tmp_path / "pets")
    store = str(tmp_path / "pets.zarr")
    info = import_image_folder(source, store, image_size=16, seed=0)
    assert (info.name, info.classes, info.image_shape) == ("image_folder", 3, (3, 16, 16))
    # no train/ and test/: a sixth of the 18 images is held out for testing
    assert (info.train_samples, info.test_samples) == (15, 3)
    assert zarr.open_group(store, mode="r").attrs["class_names"] == list(CLASSES)
    listed = list_image_folder(source, seed=0)
    every = []
    for split, samples in (("train", listed.train), ("test", listed.test)):
        images, labels = _stored(store, split)
        assert images.shape == (len(samples), 3, 16, 16) and images.dtype == np.float32
        assert labels.tolist() == [label for _, label in samples]
        every += [(os.path.relpath(path, source), label) for path, label in samples]
    # every image once, under its class folder's index; the text file is none
    assert sorted(every) == sorted(
        (os.path.join(name, f), label) for label, name in enumerate(CLASSES)
        for f in os.listdir(os.path.join(source, name)) if not f.endswith(".txt"))
    train = _stored(store, "train")[0].astype(np.float64)
    np.testing.assert_allclose(train.mean(axis=(0, 2, 3)), 0, atol=1e-5)
    np.testing.assert_allclose(train.std(axis=(0, 2, 3)), 1, atol=1e-5)
    assert verify_dataset(store).files > 0


@pytest.mark.parametrize("name, resized, box", [
    ("00.png", (16, 22), (0, 3, 16, 19)),  # 20x28: height 28 * 16/20 = 22.4 -> 22
    ("01.jpg", (23, 16), (4, 0, 20, 16)),  # 44x30: width 23.47 -> 23, left 3.5 -> 4
])
def test_an_image_is_resized_and_centre_cropped_as_pillow_does(tmp_path, name, resized, box):
    source = make_folder(tmp_path / "pets")
    store = str(tmp_path / "pets.zarr")
    import_image_folder(source, store, image_size=16, seed=0, dtype="float64")
    path = os.path.join(source, "dog", name)
    listed = list_image_folder(source, seed=0)
    split = "train" if any(p == path for p, _ in listed.train) else "test"
    row = [p for p, _ in getattr(listed, split)].index(path)
    normalization = zarr.open_group(store, mode="r").attrs["normalization"]
    mean = np.array(normalization["mean"])[:, None, None]
    std = np.array(normalization["std"])[:, None, None]
    expected = (_pillow_crop(path, resized, box) / 255.0 - mean) / std
    np.testing.assert_allclose(_stored(store, split)[0][row], expected, rtol=0, atol=1e-12)


def test_train_and_val_folders_are_the_splits_and_caps_keep_the_first(tmp_path):
    source = tmp_path / "split"
    make_folder(source / "train", per_class=4)
    make_folder(source / "val", per_class=2)
    info = import_image_folder(str(source), str(tmp_path / "a.zarr"), image_size=8)
    assert (info.classes, info.train_samples, info.test_samples) == (3, 12, 6)
    capped = import_image_folder(str(source), str(tmp_path / "b.zarr"), image_size=8,
                                 train_samples=5, test_samples=4)
    assert (capped.train_samples, capped.test_samples) == (5, 4)
    whole, part = _stored(str(tmp_path / "a.zarr"), "train"), _stored(
        str(tmp_path / "b.zarr"), "train")
    assert part[1].tolist() == whole[1][:5].tolist()  # the same order, cut
    with pytest.raises(DatasetError, match="test_samples=9, but .* holds 6 test samples"):
        import_image_folder(str(source), str(tmp_path / "c.zarr"), test_samples=9)


def test_the_seed_draws_the_split_of_an_unsplit_folder(tmp_path):
    source = make_folder(tmp_path / "pets")
    split = {seed: {p for p, _ in list_image_folder(source, seed=seed).test}
             for seed in (0, 1)}
    assert split[0] == {p for p, _ in list_image_folder(source, seed=0).test}  # determined
    assert split[0] != split[1]
    assert len(list_image_folder(source, seed=0, test_samples=5).test) == 5


# --- refusals --------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_broken_image_is_named_and_leaves_no_store(tmp_path, damage):
    source = make_folder(tmp_path / "pets")
    broken = os.path.join(source, "dog", "03.png")
    if damage == "garbage":
        with open(broken, "wb") as handle:
            handle.write(os.urandom(300))
    else:  # a valid header and half of the data
        whole = open(os.path.join(source, "dog", "01.jpg"), "rb").read()
        broken = os.path.join(source, "dog", "03.jpg")
        with open(broken, "wb") as handle:
            handle.write(whole[:len(whole) // 2])
    store = tmp_path / "pets.zarr"
    with pytest.raises(DatasetError) as raised:
        import_image_folder(source, str(store), image_size=16)
    message = str(raised.value)
    assert message.startswith(f"{broken}: not a readable image") and "\n" not in message
    assert sorted(os.listdir(tmp_path)) == ["pets"]  # no store, no half-built debris


@pytest.mark.parametrize("classes, per_class, names", [
    (("cat",), 2, "has 1 class sub-folder; at least 2 are needed"),
    ((), 2, "has 0 class sub-folders"),
    (CLASSES, 0, "class 'cat' holds no images"),
])
def test_too_few_classes_or_an_empty_class_is_one_line(tmp_path, classes, per_class, names):
    source = make_folder(tmp_path / "few", classes=classes, per_class=per_class)
    with pytest.raises(DatasetError, match=names):
        import_image_folder(source, str(tmp_path / "few.zarr"))


def test_train_and_test_folders_must_have_the_same_classes(tmp_path):
    source = tmp_path / "split"
    make_folder(source / "train", per_class=2)
    make_folder(source / "test", classes=CLASSES[:2], per_class=2)
    with pytest.raises(DatasetError, match="are not those of"):
        list_image_folder(str(source))


# --- reuse, rebuild --------------------------------------------------------------------


def test_a_store_is_rebuilt_when_the_folder_or_the_size_changes(tmp_path):
    source = make_folder(tmp_path / "pets")
    store = str(tmp_path / "pets.zarr")

    def identity() -> int:
        return os.stat(os.path.join(store, "zarr.json")).st_ino

    first = ensure_dataset(source, store, image_size=16, seed=0, classes=3)
    built = identity()
    assert ensure_dataset(source, store, image_size=16, seed=0) == first
    assert identity() == built  # reused
    assert ensure_dataset(source, store, image_size=8).image_shape == (3, 8, 8)
    _write_image(os.path.join(source, "emu", "99.png"), (12, 12), seed=9)
    assert ensure_dataset(source, store, image_size=8).train_samples == 16  # 19 images
    rebuilt = identity()
    os.rename(source, str(tmp_path / "elsewhere"))  # a store outlives its folder
    assert ensure_dataset(source, store, image_size=8).train_samples == 16
    assert identity() == rebuilt
    with pytest.raises(DatasetError, match="image folder not found"):
        ensure_dataset(source, store, image_size=16)


def test_ensure_refuses_a_class_count_the_folder_does_not_have(tmp_path):
    source = make_folder(tmp_path / "pets")
    with pytest.raises(DatasetError, match=r"10 classes asked for, .* has 3 \(cat, dog, emu\)"):
        ensure_dataset(source, str(tmp_path / "pets.zarr"), classes=10)


def test_an_image_replaced_by_one_of_its_size_and_time_rebuilds_the_store(tmp_path):
    """An uncompressed image (PPM: its size is its side's) replaced by another image of
    the same side, its modification time set back as ``rsync -a`` or ``touch -r`` do:
    path, size and time are the old ones, and the store was reused with the old
    image's pixels. The change time tells them apart."""
    source = make_folder(tmp_path / "pets")
    image = os.path.join(source, "emu", "50.ppm")
    _write_image(image, (12, 12), seed=1)
    store = str(tmp_path / "pets.zarr")
    before = ensure_dataset(source, store, image_size=8)
    old = [_stored(store, split)[0] for split in ("train", "test")]
    kept = os.stat(image)
    _write_image(image, (12, 12), seed=2)
    os.utime(image, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    assert os.stat(image).st_size == kept.st_size  # all a listing sees is as it was
    after = ensure_dataset(source, store, image_size=8)
    assert after.train_samples == before.train_samples
    new = [_stored(store, split)[0] for split in ("train", "test")]
    assert not all(np.array_equal(a, b) for a, b in zip(old, new))  # the new image's


# --- configs and runs ------------------------------------------------------------------


def test_the_default_store_path_names_the_side_unless_it_is_32(tmp_path):
    def path(**data) -> str:
        return os.path.basename(build_run_config({"data": data}).dataset_path)

    assert path() == "synthetic-5000-1000-s0-float32.zarr"
    assert path(image_size=32) == path()
    assert path(image_size=16) == "synthetic-5000-1000-s0-16px-float32.zarr"
    pets = path(source="/x/pets", image_size=64)
    assert re.fullmatch(r"pets-[0-9a-f]{8}-64px-float32\.zarr", pets), pets
    # another folder of the same name, or another order of the same folder: other stores
    assert path(source="/y/pets", image_size=64) not in (pets, "")
    assert path(source="/x/pets", image_size=64, seed=3) == pets.replace("-64px", "-s3-64px")
    assert path(source="/x/pets/", image_size=64) == pets
    with pytest.raises(ConfigError, match="data.image_size: expected an integer in \\[8, 512\\]"):
        build_run_config({"data": {"image_size": 4}})


def _train_args(tmp_path, *extra: str) -> list[str]:
    return [os.path.join(ROOT, "configs", "small.yaml"), "strategy=reference",
            f"output={tmp_path / 'run'}", "progress=false", "train.steps=2",
            "train.batch=4", "train.eval_samples=3", "network.conv.0.kernels=4",
            "network.conv.1.kernels=4", *extra]


def test_an_image_folder_trains_end_to_end(tmp_path):
    source = make_folder(tmp_path / "pets")
    store = tmp_path / "pets.zarr"
    status, lines, _ = run_main("train", _train_args(
        tmp_path, f"data.source={source}", f"data.path={store}", "data.image_size=16",
        "network.classes=3"))
    assert status == 0, lines
    record = xr.open_zarr(tmp_path / "run" / "record.zarr")
    assert record.sizes["step"] == 2 and record.attrs["dataset_source"] == source
    assert open_dataset_info(str(store)).image_shape == (3, 16, 16)


def test_a_broken_image_stops_the_command_in_one_line(tmp_path):
    source = make_folder(tmp_path / "pets")
    broken = os.path.join(source, "emu", "04.png")
    with open(broken, "wb") as handle:
        handle.write(b"\x89PNG but no image")
    store = tmp_path / "pets.zarr"
    status, lines, _ = run_main("train", _train_args(
        tmp_path, f"data.source={source}", f"data.path={store}", "network.classes=3"))
    assert_one_error_line(status, lines, 2, f"{broken}: not a readable image")
    assert not store.exists()


def test_a_class_count_the_folder_does_not_have_is_one_line(tmp_path):
    source = make_folder(tmp_path / "pets")
    status, lines, _ = run_main("train", _train_args(
        tmp_path, "--check", f"data.source={source}", f"data.path={tmp_path / 'p.zarr'}"))
    assert_one_error_line(status, lines, 2, f"network.classes: 10, but the image folder "
                                            f"{source} has 3 classes (cat, dog, emu)")


def test_cifar10_takes_no_other_image_size(tmp_path):
    from tests.test_datasets import _cifar_batches, _write_archive

    archive = _write_archive(tmp_path / "cifar-10-python.tar.gz", _cifar_batches())
    status, lines, _ = run_main("train", _train_args(
        tmp_path, "--check", f"data.source={archive}", f"data.path={tmp_path / 'c.zarr'}",
        "data.image_size=64"))
    assert_one_error_line(status, lines, 2, "data.image_size: 64, but CIFAR-10's images "
                                            "are 32x32")


def test_synthetic_images_of_side_16_train_with_the_default_network(tmp_path):
    config = tmp_path / "default.yaml"
    config.write_text("strategy: reference\n")  # the default network: conv 32 and 64, 5x5
    store = tmp_path / "s16.zarr"
    status, lines, _ = run_main("train", [
        str(config), f"output={tmp_path / 'run'}", "progress=false", f"data.path={store}",
        "data.image_size=16", "data.train_samples=32", "data.test_samples=8",
        "train.steps=1", "train.batch=8", "train.eval_samples=8"])
    assert status == 0, lines
    assert open_dataset_info(str(store)).image_shape == (3, 16, 16)
    assert xr.open_zarr(tmp_path / "run" / "record.zarr").sizes["step"] == 1


def test_check_refuses_what_the_folders_listing_says_the_run_would(tmp_path):
    """`--check` said "fine" to an image folder the run then refused: a class without
    images, a sample count larger than the folder holds, a batch larger than its
    training images. It lists the folder now (no image decoded) and refuses each in
    the run's words, naming the field."""
    source = make_folder(tmp_path / "pets")  # 18 images: 15 train, 3 test
    args = [f"data.source={source}", f"data.path={tmp_path / 'p.zarr'}", "network.classes=3"]
    cases = [
        (["data.train_samples=16"], "data.train_samples: 16, but the image folder "
                                    f"{source} holds 15 train samples"),
        (["data.test_samples=18"], f"data.test_samples: 18, but the image folder {source} "
                                   "holds 18 images, and at least one must be left to train"),
        (["train.batch=16"], "train.batch: 16 is larger than the 15 training samples"),
    ]
    for extra, names in cases:
        for check in (["--check"], []):
            status, lines, _ = run_main("train", _train_args(tmp_path, *args, *extra, *check))
            assert_one_error_line(status, lines, 2, names)
    os.makedirs(os.path.join(source, "fox"))
    for check in (["--check"], []):
        status, lines, _ = run_main("train", _train_args(
            tmp_path, *args[:2], "network.classes=4", *check))
        assert_one_error_line(status, lines, 2, "class 'fox' holds no images")
    assert not os.path.exists(tmp_path / "p.zarr")


def test_a_link_back_up_the_folder_is_refused_not_walked_round(tmp_path):
    """A class folder holding a link to a folder above it (`cat/up -> ..`) was walked
    round the loop until the system's limit on links in a path: every image of every
    class listed again some 40 times under that one class, with nothing said."""
    source = make_folder(tmp_path / "pets")
    link = os.path.join(source, "cat", "up")
    os.symlink("..", link)
    with pytest.raises(DatasetError, match=f"{link} links to {source}, a folder above it"):
        list_image_folder(source)
    status, lines, _ = run_main("train", _train_args(
        tmp_path, "--check", f"data.source={source}", f"data.path={tmp_path / 'p.zarr'}",
        "network.classes=3"))
    assert_one_error_line(status, lines, 2, f"{link} links to {source}")
    os.remove(link)
    os.symlink(os.path.join(source, "dog"), link)  # a link elsewhere: followed, as before
    assert len(list_image_folder(source).train) == 15 + 5


def test_a_loop_of_two_links_is_refused_not_walked_round(tmp_path):
    """Two class folders linking to each other (`cat/more -> ../dog`, `dog/more ->
    ../cat`): neither link names a folder above it, and the listing went round the
    loop to the system's limit, 6 images of 2 classes listed as 246, silently. A link
    to a folder the walk is already inside is refused, naming it; a link to a sibling
    that leads nowhere back stays followed."""
    source = make_folder(tmp_path / "pets")
    os.symlink(os.path.join("..", "dog"), os.path.join(source, "cat", "more"))
    back = os.path.join(source, "dog", "more")
    os.symlink(os.path.join("..", "cat"), back)
    with pytest.raises(DatasetError, match="links to .*, a folder the listing is already in"):
        list_image_folder(source)
    os.remove(back)
    assert len(list_image_folder(source).train) == 15 + 5
