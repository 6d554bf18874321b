"""benchmarks/side_by_side.py's warm contenders: a burst of steps goes on where the
last one stopped, on an engine sharing the real cluster and on the in-process
reference, so that the bursts of a round train what one run would."""

from __future__ import annotations

import numpy as np

from benchmarks.side_by_side import loop_contender
from pipeline.cluster.worker_setup import register_setup
from pipeline.cluster.workers import find_workers
from tests.helpers import tiny_config


def test_bursts_continue_where_the_last_stopped(tmp_path, three_worker_cluster,
                                                tiny_dataset_factory):
    client, cluster_config = three_worker_cluster
    dataset = tiny_dataset_factory()
    reference = loop_contender("reference", tiny_config(
        tmp_path / "reference", dataset, strategy="reference", **{"train.eval_samples": 0}))
    config = tiny_config(tmp_path / "kernel", dataset, **{"train.eval_samples": 0})
    config.cluster.workers = cluster_config.workers
    register_setup(client, config.cluster)
    kernel = loop_contender("kernel", config, client, find_workers(client, config.cluster)[:2])
    try:
        for contender in (reference, kernel):
            times = contender.burst(2) + contender.burst(3)
            assert len(times) == 5 and all(t > 0 for t in times)
            assert sorted(contender.recorder.steps) == [0, 1, 2, 3, 4]
    finally:
        kernel.close()
        reference.close()
    losses = {c.name: [c.recorder.steps[s]["loss"] for s in range(5)]
              for c in (reference, kernel)}
    assert len(set(losses["reference"])) == 5  # five different batches, not one repeated
    np.testing.assert_allclose(losses["kernel"], losses["reference"], rtol=1e-5)
