"""A `data`/`hybrid` run that leaves a worker out (it got no samples: a calibrated
split that found it too slow, a recorded one) records its batch shares by the workers
that trained, as `kernel` records its kernels: `batch_split` has a count per worker
of `split_workers`. Before, it kept a count per worker offered, zeros included, so
the placement line paired the names with the wrong counts ("cpu-0 8, cpu-2 0" for a
split that gave cpu-2 8 samples), `placement: recorded` from the run's directory was
refused ("they add up to 8"), and the model priced the shares on the wrong workers.
Real Dask workers (the shared cluster's three CPU ones), real Zarr stores.
"""

from __future__ import annotations

import json

import pytest

from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import find_workers
from pipeline.run import run_training
from tests.helpers import tiny_config


def _run(folder, cluster, dataset, strategy: str, split_from: str):
    client, cluster_config = cluster
    config = tiny_config(folder, dataset, **{
        "strategy": strategy, "placement": "recorded", "split_from": split_from,
        "train.steps": 2, "train.eval_samples": 0, "progress": True, "prediction": "never"})
    config.cluster.workers = cluster_config.workers
    register_setup(client, config.cluster)
    return config, run_training(config, client=client,
                                offered=find_workers(client, config.cluster))


@pytest.mark.parametrize("strategy", ["data", "hybrid"])
def test_a_left_out_worker_has_no_column_in_the_batch_split(tmp_path, three_worker_cluster,
                                                           tiny_dataset_factory, capsys,
                                                           strategy):
    dataset = tiny_dataset_factory("float32")
    config, result = _run(tmp_path / "first", three_worker_cluster, dataset, strategy,
                          "[[8, 0, 8]]")
    summary = result.summary
    assert summary["split_workers"] == ["cpu-0", "cpu-2"]
    assert summary["batch_split"] == [8, 8]
    assert json.loads(result.record.attrs["batch_split"]) == [8, 8]
    said = capsys.readouterr().err
    assert "placed: samples of each batch: cpu-0 8, cpu-2 8 (master cpu-0)" in said, said
    # the run's directory as `split_from` gives its split again, worker by worker
    _config, again = _run(tmp_path / "again", three_worker_cluster, dataset, strategy,
                          config.output_dir)
    assert again.summary["split_workers"] == ["cpu-0", "cpu-2"]
    assert again.summary["batch_split"] == [8, 8]
