"""Which probe a run config's prediction stands on: the policy (``$CNN_PREDICT_PROBE``),
the cache, or a probe measured now on the config's cluster.

pipeline/prediction.py is the model given a probe; this module gets the probe. The
policies: ``auto`` measures when none is cached or the cached one is older than
``$CNN_PROBE_MAX_AGE`` (:func:`pipeline.probe.cache.probe_max_age`), starting the
config's embedded cluster or connecting to its scheduler; ``never`` probes no cluster;
``cached`` measures nothing, and takes a cached probe at any age.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

from pipeline.cluster.connect import open_client
from pipeline.cluster.worker_setup import workers_set_up
from pipeline.cluster.shared_paths import check_workers_code
from pipeline.cluster.workers import (ClusterError, SchedulerLost, WorkerLost, all_local,
                                      find_workers, scheduler_address, started_elsewhere)
from pipeline.config.run_config import RunConfig
from pipeline.config.schema import ConfigError
from pipeline.engine.dataset import prepare_dataset
from pipeline.probe import (ClusterProbe, cached_probe, find_cached_probe, links_key,
                            probe_key, probe_max_age, probe_workspace_dir,
                            worker_identities, worker_identity, workspace_location)
from pipeline.strategies.base import network_for
from storage.datasets import DatasetError

__all__ = ["PROBE_POLICIES", "check_probe_environment", "prepare_probe_dataset",
           "probe_for_config", "probe_policy"]


def prepare_probe_dataset(config: RunConfig) -> None:
    """Build the config's dataset store if it can be (else the probe falls back)."""
    try:
        prepare_dataset(config)
    except (DatasetError, OSError):
        pass


#: The values of ``$CNN_PREDICT_PROBE`` (module doc).
PROBE_POLICIES = ("auto", "cached", "never")


def probe_policy() -> str:
    """The sweeps' probe policy: ``$CNN_PREDICT_PROBE`` (module doc), default ``auto``;
    another value is a `ConfigError` naming it."""
    policy = os.environ.get("CNN_PREDICT_PROBE", "auto").strip().lower() or "auto"
    if policy not in PROBE_POLICIES:
        raise ConfigError(f"CNN_PREDICT_PROBE={policy!r}: expected one of "
                          f"{', '.join(PROBE_POLICIES)}")
    return policy


def check_probe_environment() -> None:
    """Before a run or sweep starts: the probe's environment variables
    (``$CNN_PREDICT_PROBE``, ``$CNN_PROBE_MAX_AGE``) hold values they can take, so a
    typo is one line now rather than a failure at the first prediction."""
    probe_policy()
    probe_max_age()


def probe_for_config(config: RunConfig, client: Any = None, offered: Any = None,
                     policy: str | None = None, sample: bool = False) -> ClusterProbe | None:
    """A cluster probe for ``config``'s cluster: cached, or measured per ``policy``.

    The probe covers every worker offering the config's resource tag (a
    point using fewer is predicted on the first of them).  With ``client``
    (and optionally ``offered``) it probes that cluster; otherwise, under the
    ``auto`` policy, it connects to the config's scheduler or starts the
    config's embedded cluster for the probe.  Workers behind shaped links
    (``cluster.link``) are probed across them: the store's figures then hold the
    link's rate and the transport's per-access cost, and the probe is cached for
    those links only.

    Workers started elsewhere (a named scheduler's, batch jobs) that run other code of
    this project than this process are refused as a run refuses them
    (`check_workers_code`): the probe fails with the run's line naming the worker.

    ``sample=True`` (policy ``auto`` only) measures one more sample of the cluster
    however fresh its cached probe, and gives the median of every figure over its
    recent samples (pipeline/probe/samples.py): what a sweep does at each repeat.
    """
    policy = policy or probe_policy()
    sample = sample and policy == "auto"
    if policy == "never" or config.cluster.workspace_transport() == "s3":
        return None  # the probe's calibration runs exchange over sftp: not s3's costs
    if policy == "auto" and config.built_dataset() is None:
        prepare_probe_dataset(config)  # the calibration runs train on it, as the run would
    spec, batch = network_for(config), config.train.batch
    quanta, dataset = config.channel_quanta(spec), config.built_dataset()
    cluster = dataclasses.replace(config.cluster, use_workers=None)
    where = probe_workspace_dir(config)
    links = links_key(config.cluster.link_rates())
    batch_norm = config.train.batch_norm  # the replica plan's trunk, as the run's replicas
    # over a link, the calibration runs' checkpoints go where the workers reach
    output_root = config.output_dir if links else None
    if client is None and scheduler_address(cluster) is None:
        # an embedded cluster: its worker set is known without starting it
        tagged = sorted((w for w in cluster.worker_list() if w.resources.get(cluster.resource, 0) >= 1),
                        key=lambda w: str(w.name))
        identity = [(w.name, w.threads, w.speed, cluster.resource) for w in tagged]
        location = workspace_location(not links, where)  # linked workers: other hosts
        cached = find_cached_probe(probe_key(spec, batch, quanta, identity, location, dataset,
                                             links, batch_norm), any_age=policy == "cached")
        if (cached is not None and not sample) or policy == "cached":
            return cached
    elif policy == "cached":
        if client is None:
            return None
        offered = offered or find_workers(client, cluster)
        location = workspace_location(all_local(list(offered)), where)
        identity = worker_identity(offered, worker_identities(client, offered))
        return find_cached_probe(probe_key(spec, batch, quanta, identity, location, dataset,
                                           links, batch_norm), any_age=True)
    try:
        if client is not None:
            offered = offered or find_workers(client, cluster)
            return cached_probe(client, offered, spec, batch, quanta, where, dataset,
                                links=links, output_root=output_root, sample=sample,
                                batch_norm=batch_norm)
        if output_root:
            os.makedirs(output_root, exist_ok=True)
        with open_client(cluster, config.shared_directories()) as own, \
                workers_set_up(own, cluster):
            offered = find_workers(own, cluster)
            if started_elsewhere(cluster):  # as a run checks them: a probe's figures
                check_workers_code(own, offered)  # from other code mislead, and are cached
            return cached_probe(own, offered, spec, batch, quanta, where, dataset,
                                links=links, output_root=output_root, sample=sample,
                                batch_norm=batch_norm)
    except (WorkerLost, SchedulerLost):
        raise  # the run's to recover from, or to stop on
    except (ClusterError, OSError, TimeoutError) as error:
        print(f"warning: the model's probe of this cluster failed: {error}", file=sys.stderr)
        return None
