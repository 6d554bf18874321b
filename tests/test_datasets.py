"""Tests for storage.datasets: CIFAR-10 import, synthetic data, batch reads, errors.

CIFAR-10 cannot be downloaded here, so the tests write tiny archives in the real
format: pickled dicts with bytes keys (protocol 2, arrays referencing numpy.core as
the original file does) under cifar-10-batches-py/, tarred and gzipped.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import tarfile

import numpy as np
import pytest
import zarr

from storage.datasets import (
    DatasetError,
    DatasetInfo,
    clear_read_cache,
    create_synthetic_dataset,
    ensure_dataset,
    import_cifar10,
    open_dataset_info,
    read_batch,
)
from storage.datasets import cifar10, ensure, reader, shard_reader, synthetic, writer

TRAIN_PER_BATCH = 3  # 5 batches -> 15 train samples
TEST_SAMPLES = 4


@pytest.fixture(autouse=True)
def small_shards(monkeypatch):
    """Several shards (and a partial last one) even in tiny stores."""
    monkeypatch.setattr(writer, "SHARD_SAMPLES", 4)
    clear_read_cache()
    yield
    clear_read_cache()


def _pickle_like_cifar(obj: dict) -> bytes:
    raw = pickle.dumps(obj, protocol=2)
    # The original was written by numpy 1.x, whose pickles name numpy.core.
    return raw.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")


def _cifar_batches(seed: int = 0) -> dict[str, dict]:
    rng = np.random.default_rng(seed)
    batches = {}
    for i in range(1, 6):
        n = TRAIN_PER_BATCH
        batches[f"data_batch_{i}"] = {
            b"batch_label": f"training batch {i} of 5".encode(),
            b"labels": [int(v) for v in rng.integers(0, 10, n)],
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"filenames": [f"img_{i}_{j}.png".encode() for j in range(n)],
        }
    batches["test_batch"] = {
        b"batch_label": b"testing batch 1 of 1",
        b"labels": [int(v) for v in rng.integers(0, 10, TEST_SAMPLES)],
        b"data": rng.integers(0, 256, (TEST_SAMPLES, 3072), dtype=np.uint8),
        b"filenames": [f"test_{j}.png".encode() for j in range(TEST_SAMPLES)],
    }
    batches["batches.meta"] = {
        b"num_cases_per_batch": TRAIN_PER_BATCH,
        b"label_names": [n.encode() for n in ("airplane", "automobile", "bird", "cat", "deer",
                                               "dog", "frog", "horse", "ship", "truck")],
        b"num_vis": 3072,
    }
    return batches


def _write_folder(root, batches: dict[str, dict]) -> str:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name, content in batches.items():
        (folder / name).write_bytes(_pickle_like_cifar(content))
    return str(folder)


def _write_archive(path, batches: dict[str, dict]) -> str:
    with tarfile.open(path, "w:gz") as archive:
        folder = tarfile.TarInfo("cifar-10-batches-py")
        folder.type = tarfile.DIRTYPE
        archive.addfile(folder)
        for name, content in batches.items():
            raw = _pickle_like_cifar(content)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(raw)
            archive.addfile(info, io.BytesIO(raw))
    return str(path)


def _expected(batches: dict[str, dict]):
    """Independent computation of the normalised CIFAR arrays."""
    train = np.concatenate([batches[f"data_batch_{i}"][b"data"] for i in range(1, 6)])
    train_labels = np.concatenate([batches[f"data_batch_{i}"][b"labels"] for i in range(1, 6)])
    test = batches["test_batch"][b"data"]
    train = train.reshape(-1, 3, 32, 32).astype(np.float64) / 255
    test = test.reshape(-1, 3, 32, 32).astype(np.float64) / 255
    mean = train.mean(axis=(0, 2, 3))
    std = train.std(axis=(0, 2, 3))

    def norm(x):
        return (x - mean[:, None, None]) / std[:, None, None]

    test_labels = np.array(batches["test_batch"][b"labels"])
    return norm(train), train_labels, norm(test), test_labels, mean, std


def _read_all(path: str, split: str):
    info = open_dataset_info(path)
    n = info.train_samples if split == "train" else info.test_samples
    return read_batch(path, split, np.arange(n))


# --- CIFAR-10 import ---------------------------------------------------------------


@pytest.mark.parametrize("form", ["archive", "folder", "folder_parent", "archive_parent"])
def test_cifar_import_round_trip(tmp_path, form):
    batches = _cifar_batches()
    if form in ("archive", "archive_parent"):
        source = _write_archive(tmp_path / "cifar-10-python.tar.gz", batches)
        if form == "archive_parent":
            source = str(tmp_path)
    else:
        source = _write_folder(tmp_path / "src", batches)
        if form == "folder_parent":
            source = str(tmp_path / "src")
    store = str(tmp_path / "cifar.zarr")
    info = import_cifar10(source, store)

    train, train_labels, test, test_labels, mean, std = _expected(batches)
    assert info == DatasetInfo(os.path.abspath(store), "cifar10", 10, (3, 32, 32),
                               len(train), len(test), "float32", info.source)
    assert os.path.exists(info.source)
    images, labels = _read_all(store, "train")
    assert images.dtype == np.float32 and labels.dtype == np.int64
    np.testing.assert_allclose(images, train, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(labels, train_labels)
    images, labels = _read_all(store, "test")
    np.testing.assert_allclose(images, test, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(labels, test_labels)

    attrs = zarr.open_group(store, mode="r").attrs
    np.testing.assert_allclose(attrs["normalization"]["mean"], mean, rtol=1e-12)
    np.testing.assert_allclose(attrs["normalization"]["std"], std, rtol=1e-12)
    assert attrs["class_names"][0] == "airplane"


def test_cifar_import_float64_and_first_n(tmp_path):
    batches = _cifar_batches(1)
    source = _write_archive(tmp_path / "cifar-10-python.tar.gz", batches)
    store = str(tmp_path / "c.zarr")
    info = import_cifar10(source, store, dtype="float64", train_samples=7, test_samples=2)
    assert (info.train_samples, info.test_samples, info.dtype) == (7, 2, "float64")
    raw = np.concatenate([batches[f"data_batch_{i}"][b"data"] for i in range(1, 6)])[:7]
    raw = raw.reshape(-1, 3, 32, 32) / 255.0
    mean, std = raw.mean(axis=(0, 2, 3)), raw.std(axis=(0, 2, 3))
    expected = (raw - mean[:, None, None]) / std[:, None, None]
    images, labels = _read_all(store, "train")
    assert images.dtype == np.float64
    np.testing.assert_allclose(images, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(labels, batches["data_batch_1"][b"labels"]
                                  + batches["data_batch_2"][b"labels"]
                                  + batches["data_batch_3"][b"labels"][:1])
    with pytest.raises(DatasetError, match="train_samples=99"):
        import_cifar10(source, str(tmp_path / "d.zarr"), train_samples=99)


def test_normalised_train_split_has_zero_mean_unit_std(tmp_path):
    source = _write_archive(tmp_path / "cifar-10-python.tar.gz", _cifar_batches())
    cifar = str(tmp_path / "c.zarr")
    import_cifar10(source, cifar, dtype="float64")
    synthetic_store = str(tmp_path / "s.zarr")
    create_synthetic_dataset(synthetic_store, train_samples=30, test_samples=10, dtype="float64")
    for store in (cifar, synthetic_store):
        images, _ = _read_all(store, "train")
        np.testing.assert_allclose(images.mean(axis=(0, 2, 3)), 0.0, atol=1e-9)
        np.testing.assert_allclose(images.std(axis=(0, 2, 3)), 1.0, atol=1e-9)


# --- read_batch ----------------------------------------------------------------------


def test_read_batch_returns_rows_in_index_order(tmp_path):
    store = str(tmp_path / "s.zarr")
    create_synthetic_dataset(store, train_samples=11, test_samples=3)  # shards 4+4+3
    everything, all_labels = _read_all(store, "train")
    indices = np.array([9, 2, 2, 10, 0, 9, 5, 3])
    images, labels = read_batch(store, "train", indices)
    np.testing.assert_array_equal(images, everything[indices])
    np.testing.assert_array_equal(labels, all_labels[indices])
    # the same rows through Zarr itself (unsorted, repeated indices)
    direct = zarr.open_array(store, path="train/images", mode="r")
    np.testing.assert_array_equal(images, np.stack([direct[int(i)] for i in indices]))
    assert read_batch(store, "test", np.array([], dtype=np.int64))[0].shape == (0, 3, 32, 32)


def test_fast_reader_is_used_and_matches_zarr_path(tmp_path):
    store = str(tmp_path / "s.zarr")
    create_synthetic_dataset(store, train_samples=10, test_samples=2, dtype="float64")
    read_batch(store, "train", np.array([0]))
    (split_reader,) = [reader._split_reader(*key) for key in _cached_keys(store, "train")]
    assert split_reader.fast is not None, "the shard reader should accept the layout we write"
    indices = np.array([7, 1, 8, 1, 4])
    np.testing.assert_array_equal(split_reader.read(indices)[0],
                                  split_reader.read_with_zarr(indices))


def test_slow_rows_are_read_by_threads_in_the_same_order(tmp_path, monkeypatch):
    """Rows that look like round trips to a file server (here: any row) switch the
    reader to its threads after the first batch; the rows come back as read alone,
    in index order, repeats and shards mixed, and a thread's error reaches the caller."""
    monkeypatch.setattr(shard_reader, "ROUND_TRIP_S", 0.0)
    store = str(tmp_path / "s.zarr")
    create_synthetic_dataset(store, train_samples=30, test_samples=2)  # 8 shards of 4
    everything, _ = _read_all(store, "train")
    clear_read_cache()
    first = np.arange(30)[::-1]
    np.testing.assert_array_equal(read_batch(store, "train", first)[0], everything[first])
    (split_reader,) = [reader._split_reader(*key) for key in _cached_keys(store, "train")]
    assert split_reader.fast.parallel is True
    used = []
    real_pool = shard_reader._read_pool
    monkeypatch.setattr(shard_reader, "_read_pool", lambda: used.append(1) or real_pool())
    indices = np.random.default_rng(0).integers(0, 30, 37)
    np.testing.assert_array_equal(read_batch(store, "train", indices)[0], everything[indices])
    assert used, "a slow store's batch should go through the reading threads"
    monkeypatch.setattr(split_reader.fast, "row_nbytes", split_reader.fast.row_nbytes + 4)
    with pytest.raises(DatasetError, match="expected"):
        read_batch(store, "train", indices)


def test_fast_rows_are_read_by_the_caller_alone(tmp_path, monkeypatch):
    """From the page cache a row takes microseconds: no threads."""
    monkeypatch.setattr(shard_reader, "ROUND_TRIP_S", 1.0)
    store = str(tmp_path / "s.zarr")
    create_synthetic_dataset(store, train_samples=30, test_samples=2)
    monkeypatch.setattr(shard_reader, "_read_pool", lambda: pytest.fail("threads used"))
    for _ in range(2):
        read_batch(store, "train", np.arange(30))
    (split_reader,) = [reader._split_reader(*key) for key in _cached_keys(store, "train")]
    assert split_reader.fast.parallel is False


def _cached_keys(store: str, split: str):
    stat = os.stat(os.path.join(store, "zarr.json"))
    return [(os.path.abspath(store), split, (stat.st_ino, stat.st_mtime_ns))]


def test_read_batch_rejects_bad_requests(tmp_path):
    store = str(tmp_path / "s.zarr")
    create_synthetic_dataset(store, train_samples=5, test_samples=2)
    with pytest.raises(IndexError, match=r"\[0, 5\)"):
        read_batch(store, "train", np.array([0, 5]))
    with pytest.raises(IndexError):
        read_batch(store, "train", np.array([-1]))
    with pytest.raises(ValueError, match="split"):
        read_batch(store, "validation", np.array([0]))
    with pytest.raises(TypeError):
        read_batch(store, "train", np.array([0.5]))


def test_read_batch_sees_a_store_rebuilt_at_the_same_path(tmp_path):
    store = str(tmp_path / "s.zarr")
    create_synthetic_dataset(store, train_samples=6, test_samples=2, seed=1)
    first, _ = read_batch(store, "train", np.arange(6))
    create_synthetic_dataset(store, train_samples=6, test_samples=2, seed=2, overwrite=True)
    second, _ = read_batch(store, "train", np.arange(6))
    assert not np.array_equal(first, second)


def test_damaged_shard_index_is_reported(tmp_path):
    store = str(tmp_path / "s.zarr")
    create_synthetic_dataset(store, train_samples=8, test_samples=2)
    shard = tmp_path / "s.zarr" / "train" / "images" / "c" / "1" / "0" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 0xFF  # inside the shard index, covered by its crc32c
    shard.write_bytes(bytes(raw))
    read_batch(store, "train", np.array([0, 3]))  # shard 0 is intact
    with pytest.raises(DatasetError, match="damaged index"):
        read_batch(store, "train", np.array([5]))


# --- synthetic data ------------------------------------------------------------------


def test_synthetic_is_deterministic_from_seed(tmp_path):
    def build(name, seed):
        store = str(tmp_path / name)
        create_synthetic_dataset(store, train_samples=12, test_samples=5, seed=seed)
        return _read_all(store, "train"), _read_all(store, "test")

    a, b, c = build("a.zarr", 3), build("b.zarr", 3), build("c.zarr", 4)
    for split in range(2):
        assert a[split][0].tobytes() == b[split][0].tobytes()
        np.testing.assert_array_equal(a[split][1], b[split][1])
        assert not np.allclose(a[split][0], c[split][0])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_synthetic_shapes_dtypes_and_balanced_labels(tmp_path, dtype):
    store = str(tmp_path / "s.zarr")
    info = create_synthetic_dataset(store, train_samples=23, test_samples=10,
                                    image_shape=(2, 12, 10), classes=5, dtype=dtype)
    assert info == DatasetInfo(os.path.abspath(store), "synthetic", 5, (2, 12, 10), 23, 10,
                               dtype, "synthetic")
    assert open_dataset_info(store) == info
    for split, n in (("train", 23), ("test", 10)):
        images, labels = _read_all(store, split)
        assert images.shape == (n, 2, 12, 10) and images.dtype == np.dtype(dtype)
        assert labels.dtype == np.int64
        counts = np.bincount(labels, minlength=5)
        assert counts.max() - counts.min() <= 1 and counts.sum() == n
        assert np.isfinite(images).all()


@pytest.mark.parametrize("side", [8, 16, 32])
def test_synthetic_classes_differ_beyond_noise(tmp_path, side):
    """Class means are well separated: the data carries a learnable signal, at every
    image size a config takes."""
    store = str(tmp_path / "s.zarr")
    create_synthetic_dataset(store, train_samples=400, test_samples=10, classes=4,
                             image_shape=(3, side, side))
    images, labels = _read_all(store, "train")
    means = np.stack([images[labels == k].mean(axis=0) for k in range(4)])
    nearest = np.argmin(((images[:, None] - means[None]) ** 2).sum(axis=(2, 3, 4)), axis=1)
    assert (nearest == labels).mean() > 0.5  # chance is 0.25


def test_synthetic_float32_and_float64_hold_the_same_values(tmp_path):
    create_synthetic_dataset(str(tmp_path / "a.zarr"), train_samples=6, test_samples=2)
    create_synthetic_dataset(str(tmp_path / "b.zarr"), train_samples=6, test_samples=2,
                             dtype="float64")
    single = _read_all(str(tmp_path / "a.zarr"), "train")[0]
    double = _read_all(str(tmp_path / "b.zarr"), "train")[0]
    np.testing.assert_allclose(single, double, rtol=1e-5, atol=1e-5)


# --- errors --------------------------------------------------------------------------


def test_missing_paths_name_the_path(tmp_path):
    missing = str(tmp_path / "nowhere.zarr")
    with pytest.raises(DatasetError, match="nowhere.zarr"):
        open_dataset_info(missing)
    with pytest.raises(DatasetError, match="nowhere.zarr"):
        read_batch(missing, "train", np.array([0]))
    archive = str(tmp_path / "missing" / "cifar-10-python.tar.gz")
    with pytest.raises(DatasetError, match="missing/cifar-10-python.tar.gz"):
        import_cifar10(archive, str(tmp_path / "c.zarr"))
    with pytest.raises(DatasetError, match="missing/cifar-10-python.tar.gz"):
        ensure_dataset(archive, str(tmp_path / "c.zarr"), seed=0)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetError, match="empty"):
        import_cifar10(str(empty), str(tmp_path / "c.zarr"))
    assert not (tmp_path / "c.zarr").exists()


def test_non_dataset_paths_are_rejected(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("not zarr")
    with pytest.raises(DatasetError, match="not a Zarr group"):
        open_dataset_info(str(plain))
    group = str(tmp_path / "group.zarr")
    zarr.create_group(group, attributes={"something": "else"})
    with pytest.raises(DatasetError, match="not a dataset store"):
        open_dataset_info(group)
    # and they are never replaced, even when asked to
    with pytest.raises(DatasetError, match="refusing to overwrite"):
        create_synthetic_dataset(str(plain), train_samples=2, test_samples=1, overwrite=True)
    with pytest.raises(DatasetError, match="refusing to overwrite"):
        ensure_dataset("synthetic", group, train_samples=2, test_samples=1)
    assert (plain / "notes.txt").read_text() == "not zarr"


def test_a_store_whose_root_metadata_is_damaged_is_said_so(tmp_path):
    """A dataset store whose zarr.json was cut short was refused as "not a dataset
    store"; it is said damaged, with what to do, and still never replaced."""
    store = str(tmp_path / "s.zarr")
    create_synthetic_dataset(store, train_samples=2, test_samples=1)
    metadata = os.path.join(store, "zarr.json")
    with open(metadata, "rb") as file:
        head = file.read(100)
    with open(metadata, "wb") as file:
        file.write(head)
    with pytest.raises(DatasetError, match=r"its root metadata \(zarr.json\) is damaged.*"
                                           r"delete it \(rm -r\)"):
        ensure_dataset("synthetic", store, train_samples=4, test_samples=1)
    with open(metadata, "rb") as file:
        assert file.read() == head


def test_failed_build_leaves_the_old_store_and_no_debris(tmp_path, monkeypatch):
    store = str(tmp_path / "s.zarr")
    old = create_synthetic_dataset(store, train_samples=6, test_samples=2, seed=1)
    real_block = synthetic._SyntheticGenerator.block

    def failing_block(self, split, block, labels):
        if split == "test":
            raise RuntimeError("disk full")
        return real_block(self, split, block, labels)

    monkeypatch.setattr(synthetic._SyntheticGenerator, "block", failing_block)
    with pytest.raises(RuntimeError, match="disk full"):
        create_synthetic_dataset(store, train_samples=6, test_samples=2, seed=2, overwrite=True)
    assert open_dataset_info(store) == old
    assert zarr.open_group(store, mode="r").attrs["build"]["seed"] == 1
    assert os.listdir(tmp_path) == ["s.zarr"]


def test_existing_store_needs_overwrite(tmp_path):
    store = str(tmp_path / "s.zarr")
    create_synthetic_dataset(store, train_samples=2, test_samples=1)
    with pytest.raises(DatasetError, match="overwrite=True"):
        create_synthetic_dataset(store, train_samples=2, test_samples=1)


def test_corrupt_archives_raise_dataset_error(tmp_path):
    good = (tmp_path / "good.tar.gz")
    _write_archive(good, _cifar_batches())
    truncated = tmp_path / "truncated.tar.gz"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    garbage = tmp_path / "garbage.tar.gz"
    garbage.write_bytes(b"this is not a gzip file at all" * 10)
    for bad in (truncated, garbage):
        with pytest.raises(DatasetError, match=bad.name):
            import_cifar10(str(bad), str(tmp_path / "c.zarr"))

    batches = _cifar_batches()
    bad_member = tmp_path / "bad_member"
    folder = _write_folder(bad_member, batches)
    with open(os.path.join(folder, "data_batch_3"), "wb") as handle:
        handle.write(b"\x80\x02}q\x00(U\x04dataq")  # a pickle cut short
    with pytest.raises(DatasetError, match="data_batch_3"):
        import_cifar10(folder, str(tmp_path / "c.zarr"))

    batches["data_batch_2"][b"data"] = batches["data_batch_2"][b"data"][:, :100]
    wrong_shape = _write_archive(tmp_path / "wrong.tar.gz", batches)
    with pytest.raises(DatasetError, match="data_batch_2"):
        import_cifar10(wrong_shape, str(tmp_path / "c.zarr"))
    assert not (tmp_path / "c.zarr").exists()
    assert not [p for p in os.listdir(tmp_path) if ".building-" in p]


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo should-not-run",))


def test_archive_pickles_cannot_run_code(tmp_path):
    batches = _cifar_batches()
    batches["test_batch"][b"filenames"] = [_Exploit()]
    archive = _write_archive(tmp_path / "evil.tar.gz", batches)
    with pytest.raises(DatasetError, match="forbidden global"):
        import_cifar10(archive, str(tmp_path / "c.zarr"))


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_a_batch_pickled_by_any_protocol_loads(protocol):
    """A variant of CIFAR-10 written again by Python 3 (an empty `batch_label` is
    `__builtin__.bytes()` at protocol 2; protocol 5's arrays are numpy's `_frombuffer`)
    was refused as holding a forbidden global; it loads, the same images."""
    images = np.arange(2 * 3072, dtype=np.uint8).reshape(2, 3072)
    raw = pickle.dumps({b"data": images, b"labels": [1, 2], b"batch_label": b""},
                       protocol=protocol)
    parsed, labels = cifar10._parse_batch(raw, "x")
    assert np.array_equal(parsed.reshape(2, 3072), images) and list(labels) == [1, 2]
    # its keys as str, not bytes (CIFAR-10's own): the same batch
    raw = pickle.dumps({"data": images, "labels": [1, 2]}, protocol=protocol)
    parsed, labels = cifar10._parse_batch(raw, "x")
    assert np.array_equal(parsed.reshape(2, 3072), images) and list(labels) == [1, 2]
    with pytest.raises(DatasetError, match="b'data' must be .*, got no such key"):
        cifar10._parse_batch(pickle.dumps({"labels": [1]}, protocol=protocol), "x")


def test_a_pickle_that_asks_bytes_for_an_allocation_is_refused():
    """`bytes()` is allowed with no argument only: `bytes(10**12)` from a small file
    would ask for a terabyte."""
    raw = b"\x80\x02}q\x00C\x04dataq\x01c__builtin__\nbytes\nJ\x00\xca\x9a;\x85Rs."
    with pytest.raises(DatasetError, match="bytes\\(\\) with arguments"):
        cifar10._parse_batch(raw, "x")


# --- ensure_dataset ------------------------------------------------------------------


def test_ensure_dataset_reuses_matching_store_and_rebuilds_others(tmp_path):
    store = str(tmp_path / "s.zarr")
    first = ensure_dataset("synthetic", store, train_samples=6, test_samples=2, seed=1)
    identity = os.stat(os.path.join(store, "zarr.json")).st_ino
    again = ensure_dataset("synthetic", store, train_samples=6, test_samples=2, seed=1)
    assert again == first
    assert os.stat(os.path.join(store, "zarr.json")).st_ino == identity  # not rebuilt
    ensure_dataset("synthetic", store, train_samples=6, test_samples=2, seed=2)
    assert os.stat(os.path.join(store, "zarr.json")).st_ino != identity
    assert zarr.open_group(store, mode="r").attrs["build"]["seed"] == 2
    with pytest.raises(TypeError, match="bogus"):
        ensure_dataset("synthetic", store, bogus=1)


def test_ensure_dataset_rebuilds_a_store_of_another_image_size(tmp_path):
    store = str(tmp_path / "s.zarr")
    assert ensure_dataset("synthetic", store, train_samples=6, test_samples=2,
                          image_size=16).image_shape == (3, 16, 16)
    assert ensure_dataset("synthetic", store, train_samples=6, test_samples=2,
                          image_size=8).image_shape == (3, 8, 8)
    assert _read_all(store, "train")[0].shape == (6, 3, 8, 8)
    with pytest.raises(ValueError, match="CIFAR-10 has 10 classes of shape"):
        ensure_dataset(str(tmp_path / "cifar-10-python.tar.gz"), store, image_size=16)


def test_ensure_dataset_imports_cifar(tmp_path):
    batches = _cifar_batches()
    archive = _write_archive(tmp_path / "cifar-10-python.tar.gz", batches)
    store = str(tmp_path / "c.zarr")
    info = ensure_dataset(archive, store, seed=0, train_samples=5, test_samples=3)
    assert (info.name, info.train_samples, info.test_samples) == ("cifar10", 5, 3)
    os.remove(archive)  # a matching store no longer needs its source
    assert ensure_dataset(archive, store, seed=7, train_samples=5, test_samples=3) == info
    with pytest.raises(DatasetError, match="cifar-10-python.tar.gz"):
        ensure_dataset(archive, store, train_samples=4, test_samples=3)


def test_a_forked_child_reads_with_threads_of_its_own(tmp_path, monkeypatch):
    """The reading threads do not survive a fork: a child that inherited the parent's
    pool would wait on threads it does not have. It makes its own and reads."""
    monkeypatch.setattr(shard_reader, "ROUND_TRIP_S", 0.0)
    store = str(tmp_path / "s.zarr")
    create_synthetic_dataset(store, train_samples=30, test_samples=2)
    everything, _ = _read_all(store, "train")
    read_batch(store, "train", np.arange(30))  # the parent's pool exists now
    assert shard_reader._pool is not None
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its threaded read is right
        ok = False
        try:
            ok = shard_reader._pool is None and np.array_equal(
                read_batch(store, "train", np.arange(30)[::-1])[0], everything[::-1])
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_another_cifar_archive_of_the_same_name_is_imported_not_reused(tmp_path):
    """Every CIFAR-10 archive is called cifar-10-python.tar.gz, so variants in its format
    (corrupted or poisoned copies, a subset) share the default store path; the build
    recorded only the counts and dtype, so the second archive's run trained on the
    first's store, its attributes naming the first. The build now records the source
    and its files (path, size, modification time), as an image folder's does."""
    stores = {}
    for name, seed in (("clean", 0), ("variant", 1)):
        os.makedirs(tmp_path / name)
        stores[name] = _write_archive(tmp_path / name / "cifar-10-python.tar.gz",
                                      _cifar_batches(seed))
    store = str(tmp_path / "c.zarr")
    clean = ensure_dataset(stores["clean"], store)
    variant = ensure_dataset(stores["variant"], store)
    assert variant.source == stores["variant"] and variant.identity != clean.identity
    expected = _expected(_cifar_batches(1))
    assert np.allclose(_read_all(store, "train")[0], expected[0], atol=1e-6)
    assert ensure_dataset(stores["clean"], store).identity == clean.identity
    os.remove(stores["clean"])  # a store still outlives its archive
    assert ensure_dataset(stores["clean"], store).identity == clean.identity


def test_a_build_and_a_rebuild_in_place_are_said(tmp_path, monkeypatch):
    """A CIFAR-10 store at a path a synthetic run names was replaced by a synthetic
    one with nothing said; a build (which may take minutes) was silent too. Both are
    said now: a build once it has taken `ANNOUNCE_AFTER_S` (0 here), a rebuild at
    once, with what changed."""
    monkeypatch.setattr(ensure, "ANNOUNCE_AFTER_S", 0.0)
    archive = _write_archive(tmp_path / "cifar-10-python.tar.gz", _cifar_batches())
    store = str(tmp_path / "c.zarr")
    lines: list[str] = []
    ensure_dataset(archive, store, train_samples=5, test_samples=3, say=lines.append)
    ensure_dataset(archive, store, train_samples=5, test_samples=3, say=lines.append)
    assert lines[0] == f"dataset: building {store} from {archive} ..."  # reused: nothing
    assert re.fullmatch(f"dataset: building {re.escape(store)} from {re.escape(archive)}: "
                        r"done \(\d+\.\d s\)", lines[1]) and len(lines) == 2, lines
    del lines[:]
    monkeypatch.setattr(ensure, "ANNOUNCE_AFTER_S", 60.0)  # the rebuilds are quick here
    ensure_dataset("synthetic", store, train_samples=5, test_samples=3, say=lines.append)
    ensure_dataset("synthetic", store, train_samples=6, test_samples=3, say=lines.append)
    assert lines == [
        f"dataset: building {store} again in its place: source: {archive} -> synthetic",
        f"dataset: building {store} again in its place: train_samples: 5 -> 6"]
