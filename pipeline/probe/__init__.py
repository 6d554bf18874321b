"""Measure this cluster's constants for the cost model, on the engine itself.

The analytical model (:mod:`pipeline.costmodel`) predicts a step from shard times,
the workspace's per-access cost and bandwidth, and the engine's orchestration
latencies. A probe measures them where the step will run:

- `runs`: calibration runs of the engine's own steps at chosen splits (and a
  replica plan), `rounds`: those runs in rounds, timing again what they did not
  settle (`robust`: the statistic and the check), `readings`: what their receipts
  say;
- `client_cpu`: the client's CPU per step task and per second, from the rounds;
- `client_share`: how much of the client's CPU lands on the step where the workers
  fill the cores, by the client's own CPU clock;
- `hops`: Dask's client round trip and dependency hop (for ``sync: scheduler``);
- `reference`: plain PyTorch in this process, for ``strategy: reference``;
- `results`: what a probe holds and how it becomes cost-model objects;
- `cluster`: a cluster's probe measured whole, from all of the above;
- `keys`: what identifies a probe (its cache key);
- `samples`: several probes of one cluster as one, the median of each figure;
- `cache`: keeping probes (and their samples) as JSON, measuring where none is fresh.
"""

from pipeline.probe.cache import (cache_dir, cached_master_probe, cached_probe,
                                  cached_samples, find_cached_probe, probe_max_age)
from pipeline.probe.cluster import probe_cluster
from pipeline.probe.keys import (links_key, probe_key, probe_workspace_dir, worker_identity,
                                 workspace_location)
from pipeline.probe.machine import worker_identities, worker_machines
from pipeline.probe.reference import probe_master
from pipeline.probe.results import (PROBE_VERSION, ClusterProbe, DaskProbe, MasterProbe, StoreProbe,
                                    WorkerProbe, cluster_probe_from_dict, master_device)
from pipeline.probe.tables import (costmodel_network, dataset_store, dense_flops,
                                   model_network, network_spec_from_dict)
from pipeline.probe.timings import ShardTiming, TrunkTiming

__all__ = ["PROBE_VERSION", "ClusterProbe", "DaskProbe", "MasterProbe", "ShardTiming",
           "StoreProbe", "TrunkTiming", "WorkerProbe", "cache_dir", "cached_master_probe",
           "cached_probe", "cached_samples", "cluster_probe_from_dict", "costmodel_network",
           "dataset_store", "dense_flops", "find_cached_probe", "master_device", "model_network",
           "network_spec_from_dict", "probe_cluster", "links_key", "probe_key",
           "probe_max_age", "probe_master", "probe_workspace_dir", "worker_identity",
           "workspace_location", "worker_identities", "worker_machines"]
