"""Two ways to hand an array from one worker to another: the workspace, or Dask.

- workspace: the writer's task writes a slot and its ready marker, the reader's task
  (already running, as in a step) waits for the marker and reads (storage/exchange.py);
  the slot is written in place, as from a run's second step on (the first write,
  which creates the chunk file, is the warm-up);
- Dask: the writer's task returns the array, the reader's task takes it as an
  argument (a dependency: the scheduler hops, the array travels worker to worker).

Each is timed from the writer having the array to the reader having it, on the
workers' shared clock; medians of several repeats, for a few sizes (the small
network's gradient is 0.4 MB, the paper network's 79 MB).

    python -m benchmarks.transfer_paths
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from statistics import median

import numpy as np
from distributed import Client

from pipeline.cluster.embedded import start_embedded_cluster
from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import find_workers
from pipeline.config.cluster_config import ClusterConfig
from pipeline.engine.runner import TaskRunner
from storage.exchange import Exchange, SlotSpec, create_exchange


def write_slot(path: str, values: int, step: int) -> float:
    data = np.random.default_rng(step).standard_normal(values).astype("float32")
    start = time.time()
    Exchange(path).write("x", step, data)
    return start


def read_slot(path: str, step: int) -> float:
    exchange = Exchange(path)
    exchange.wait("x", step, timeout=60)
    exchange.read("x")
    return time.time()


def make_array(values: int, step: int) -> tuple[np.ndarray, float]:
    data = np.random.default_rng(step).standard_normal(values).astype("float32")
    return data, time.time()


def take_array(made: tuple[np.ndarray, float]) -> float:
    return time.time() - made[1]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    config = ClusterConfig(workers=2)
    cluster = start_embedded_cluster(config.worker_list())
    client = Client(cluster, set_as_default=False)
    register_setup(client, config)
    runner = TaskRunner(client, find_workers(client, config), "transfer")
    print(f"{'MB':>6}  {'workspace ms':>13}  {'Dask transfer ms':>17}")
    workdir = tempfile.mkdtemp(prefix="transfer-")
    try:
        for megabytes in (1, 10, 80):
            values = megabytes * 250_000
            workspace, dask = [], []
            path = os.path.join(workdir, f"x-{megabytes}.zarr")  # written in place, as in runs
            create_exchange(path, [SlotSpec("x", (values,), "float32")])
            for repeat in range(6):
                reader = runner.submit(read_slot, 1, path, repeat, name=f"read-{megabytes}-{repeat}")
                writer = runner.submit(write_slot, 0, path, values, repeat,
                                       name=f"write-{megabytes}-{repeat}")
                start, end = runner.gather([writer, reader], "workspace")
                made = runner.submit(make_array, 0, values, repeat, name=f"make-{megabytes}-{repeat}")
                taken = runner.submit(take_array, 1, made, name=f"take-{megabytes}-{repeat}")
                seconds = runner.gather([taken], "dask")[0]
                if repeat:  # the first of each is a warm-up
                    workspace.append(end - start)
                    dask.append(seconds)
            print(f"{megabytes:6d}  {median(workspace) * 1e3:13.1f}  {median(dask) * 1e3:17.1f}",
                  flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        client.close()
        cluster.close()


if __name__ == "__main__":
    main()
