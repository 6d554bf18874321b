"""A measured sweep's probe samples: each cluster (and this process, for `reference`)
probed once more at each repeat, where the sweep asks (``probe_samples: per_repeat``).

Why: the machine's speed moves by a few per cent within minutes, and a prediction made
from one probe carries the minute that probe ran in into every point predicted from it
(pipeline/probe/samples.py). With ``per_repeat`` the sweep takes one more sample of a
point's probe before the first point of each repeat after the first that uses it, on
freshly restarted workers, and every later prediction is made from the median of each
figure over the samples so far; the same for `reference` points, whose probe times
this process. Repeat 0's points are predicted from the first probe (taken where the
first of them finishes, as in a single run); so only sweeps with repeats pay for
samples, one probe per cluster (or reference thread count) and repeat, and only under
the ``auto`` probe policy. ``once`` is the default: on this project's 2-core hosts the
samples did not lower the model's error (docs/benchmarks.md, "Probe samples").
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable

from experiments.sweep.points import Point
from pipeline.config.run_config import RunConfig
from pipeline.prediction import network_for, probe_for_config, probe_policy
from pipeline.probe import ClusterProbe, MasterProbe, cached_master_probe, probe_workspace_dir


def probe_identity(config: RunConfig) -> str:
    """What of `config` (beside its cluster's workers) picks the cluster probe it is
    predicted from: the network, batch, channel quanta, dataset, workspace and links
    (the parts of `pipeline.probe.probe_key` that a config names). Points alike in
    these, on one worker set, share a probe; a `reference` point's probe is also
    picked by its threads and kind of SGD."""
    spec = network_for(config)
    return json.dumps({"network": dataclasses.asdict(spec), "batch": config.train.batch,
                       "quanta": list(config.channel_quanta(spec)),
                       "dataset": config.dataset_path, "workspace": probe_workspace_dir(config),
                       "links": config.cluster.link_rates(),
                       "reference": [config.reference.threads, config.optimizer_spec().kind]},
                      sort_keys=True, default=str)


class ProbeSampler:
    """Which points a sample is taken before, and taking it (a line each)."""

    def __init__(self, per_repeat: bool, echo: Callable[[str], None]) -> None:
        self.per_repeat = per_repeat
        self.echo = echo
        self._seen: set[tuple[str, str, int]] = set()

    def wanted(self, point: Point) -> bool:
        """Whether `point` is the first of its repeat (>= 1) on its probe, under the
        ``auto`` probe policy (a sweep told to measure nothing takes no sample)."""
        if not self.per_repeat:
            return False
        seen = (point.cluster_key or "", probe_identity(point.config), point.repeat)
        first = seen not in self._seen
        self._seen.add(seen)
        return first and point.repeat >= 1 and probe_policy() == "auto"

    def take(self, point: Point, client: Any) -> None:
        """Probe `point`'s cluster once more through `client` (a `reference` point: this
        process), and say so. A sample that fails is said and left out: the
        predictions keep the samples before it."""
        started = time.perf_counter()
        try:
            probe = _sample(point, client)
        except Exception as error:  # noqa: BLE001 - a sample must not fail the point
            self.echo(f"probe sample for repeat {point.repeat} failed "
                      f"({type(error).__name__}: {error}); predictions keep the earlier ones")
            return
        what = "this cluster" if point.strategy.uses_cluster else "this process"
        if probe is None:
            self.echo(f"probe sample for repeat {point.repeat}: {what} could not be "
                      "probed; predictions keep the earlier samples")
            return
        count = len(probe.created_times())
        self.echo(f"probe sample of {what} for repeat {point.repeat} "
                  f"({time.perf_counter() - started:.1f} s): predictions now take each "
                  f"figure's median over {count} sample(s)")


def _sample(point: Point, client: Any) -> ClusterProbe | MasterProbe | None:
    """One more sample of the probe `point` is predicted from."""
    config = point.config
    if point.strategy.uses_cluster:
        return probe_for_config(config, client, policy="auto", sample=True)
    return cached_master_probe(network_for(config), config.train.batch,
                               config.reference.threads, config.built_dataset(), sample=True,
                               optimizer=config.optimizer_spec())
