"""Training datasets as Zarr v3 stores that Dask workers read batches from directly.

The package is split by job; callers import the public names from here:

* `store`: the on-disk format (layout, `DatasetInfo`, errors, opening a store).
* `integrity`: chunk checksums recorded at build and `verify_dataset`.
* `writer`: building a store atomically, sharded for cheap random rows.
* `synthetic`, `cifar10`, `image_folder`: the three sources (a seeded synthetic
  maker, CIFAR-10's python release through a numpy-only unpickler, a folder of
  images with one sub-folder per class).
* `ensure`: `ensure_dataset`, reuse-or-rebuild, what every run calls.
* `reader`, `shard_reader`: `read_batch` / `read_labels` by sample index on workers.
* ``python -m storage.datasets verify PATH`` (`__main__`): check a store whole.
"""

from storage.datasets.cifar10 import import_cifar10
from storage.datasets.ensure import ensure_dataset, source_kind
from storage.datasets.image_folder import (image_folder_classes, import_image_folder,
                                           list_image_folder)
from storage.datasets.integrity import VerifyReport, verify_dataset
from storage.datasets.reader import clear_read_cache, read_batch, read_labels
from storage.datasets.store import (DatasetChanged, DatasetDamaged, DatasetError, DatasetInfo,
                                    open_dataset_info)
from storage.datasets.synthetic import create_synthetic_dataset

__all__ = [
    "DatasetChanged",
    "DatasetDamaged",
    "DatasetError",
    "DatasetInfo",
    "VerifyReport",
    "clear_read_cache",
    "create_synthetic_dataset",
    "ensure_dataset",
    "image_folder_classes",
    "import_cifar10",
    "import_image_folder",
    "list_image_folder",
    "open_dataset_info",
    "read_batch",
    "read_labels",
    "source_kind",
    "verify_dataset",
]
