"""Shared fixtures: a small synthetic dataset and a real Dask cluster.

The cluster is a real scheduler with three nanny-managed worker processes tagged
CPU=1 (the same SpecCluster the runs start), shared by a test module to keep the
suite fast.
"""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


from pipeline.config import WorkerConfig  # noqa: E402
from storage.datasets import create_synthetic_dataset  # noqa: E402
from tests.helpers import embedded_client  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dataset_factory(tmp_path_factory):
    """Build (once per dtype) a 512/128-sample synthetic dataset."""
    made = {}

    def make(dtype: str = "float32") -> str:
        if dtype not in made:
            path = str(tmp_path_factory.mktemp("data") / f"tiny-{dtype}.zarr")
            create_synthetic_dataset(path, train_samples=512, test_samples=128, seed=3,
                                     dtype=dtype)
            made[dtype] = path
        return made[dtype]

    return make


@pytest.fixture(scope="module")
def three_worker_cluster():
    """A real scheduler + 3 worker processes (CPU=1 each); yields (client, config)."""
    with embedded_client([WorkerConfig(name=f"cpu-{i}") for i in range(3)]) as made:
        yield made
