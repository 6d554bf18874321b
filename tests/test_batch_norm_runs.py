"""`data` runs of a batch-norm network whose features reach 1x1, on real Dask workers:
the calibration times no replica on one row, and local batch norm gives no replica
one row (tests/test_batch_norm_rows.py has the rules alone).

The network is tiny (a conv, a pool to 1x1, a conv with batch norm on 1x1 features),
so a run costs about the cluster's per-run setup.
"""

from __future__ import annotations

import json

import numpy as np

from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import find_workers
from pipeline.run import run_training
from pipeline.training.outputs import PREDICTION_KEYS
from tests.helpers import tiny_config, undocumented_summary_keys

SQUEEZED = ("[{conv: 4, batch_norm: true}, {pool: adaptive_avg}, "
            "{conv: 4, batch_norm: true}]")


def _run(tmp_path, cluster, dataset, **overrides):
    client, cluster_config = cluster
    config = tiny_config(tmp_path, dataset, **{
        "strategy": "data", "network.layers": SQUEEZED, "train.steps": 2,
        "train.eval_samples": 0, **overrides})
    config.cluster.workers = cluster_config.workers
    register_setup(client, config.cluster)
    return run_training(config, client=client, offered=find_workers(client, config.cluster))


def test_calibrated_replicas_are_timed_on_two_rows_at_least(tmp_path, three_worker_cluster,
                                                           tiny_dataset_factory):
    """A batch of 13 over 3 workers: the replica was timed on a quarter of its even
    share, one row, and every worker's calibration failed in batch norm."""
    result = _run(tmp_path, three_worker_cluster, tiny_dataset_factory("float32"),
                  placement="calibrated", **{"train.batch": 13})
    assert result.record.attrs["placement"] == "calibrated"
    assert sum(result.summary["batch_split"]) == 13
    assert not undocumented_summary_keys(result.summary)  # docs/outputs.md names every key
    # no probe cached, so no prediction: its keys are there, null (they were absent)
    assert result.summary["predicted_step_time"] is None and result.summary["prediction_note"]
    assert {key: result.summary[key] for key in PREDICTION_KEYS} == dict.fromkeys(
        PREDICTION_KEYS)
    points = json.loads(result.record.attrs["placement_choice"])["calibration_points"]
    assert sorted({rows for worker in points.values() for rows, _s in worker[0]}) == [2, 5]
    assert np.isfinite(result.record.loss.values).all()


def test_local_batch_norm_gives_no_replica_one_row(tmp_path, three_worker_cluster,
                                                   tiny_dataset_factory):
    """An even split of 4 over 3 workers is [2, 1, 1]: two replicas that each normalise
    one value per channel. The lone rows are merged; the third worker leaves."""
    result = _run(tmp_path, three_worker_cluster, tiny_dataset_factory("float32"),
                  placement="even", **{"train.batch": 4, "train.batch_norm": "local"})
    assert result.summary["batch_split"] == [2, 2]  # a count per worker that trains
    assert result.summary["split_workers"] == ["cpu-0", "cpu-1"]
    [why] = result.summary["left_out"]
    assert why.startswith("worker cpu-2 left out: its 1 sample(s) of the even split went "
                          "to another replica (train.batch_norm: local")
    assert np.isfinite(result.record.loss.values).all()
