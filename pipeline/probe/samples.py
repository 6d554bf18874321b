"""Several probes of one cluster as one: the median of each figure over the samples.

Why: a host's speed moves by about 5 % within minutes (docs/benchmarks.md, "The model's
error": three probes of one cluster in a row read its replica trunk at 482, 459 and
466 ms, each settled within 4 %), and every prediction made from one probe
inherits the minute it ran in. A measured sweep with repeats can probe each cluster
again at each repeat (`experiments.sweep`, ``probe_samples: per_repeat``) and predict
from the median of every figure over the samples taken so far: a sample of the
machine spread over the sweep's time instead of one stretch of it. (On this project's
2-core hosts it did not lower the error: there the runs themselves moved as much
between repeats, docs/benchmarks.md, "Probe samples".) Nothing here looks at a run's
measured steps.

`merge_samples` is a pure function of the probes. Figures are matched by what they
measure (a shard timing by layer, kernels and workers running; a worker by name; a
trunk by rows and workers running); one that only some samples hold takes the median
of those. Counts (rounds, steps) add up; a timing stays settled only if every sample
settled it, and is an outlier where most samples marked it one. The client's share
of the cores is figured again from every sample's rounds together.
"""

from __future__ import annotations

from dataclasses import fields, replace
from statistics import median
from typing import Any, Callable, Sequence, TypeVar

from pipeline.probe.client_share import median_share
from pipeline.probe.results import ClusterProbe, DaskProbe, MasterProbe, StoreProbe, WorkerProbe
from pipeline.probe.timings import ShardTiming, TrunkTiming

__all__ = ["merge_samples", "merge_master_samples", "MAX_SAMPLES"]

#: The most samples a cluster's probe keeps (the newest): enough for a median to
#: stand against one sample taken in a burst of load, few enough that a sweep's
#: probes stay a small share of its time.
MAX_SAMPLES = 5

T = TypeVar("T")
P = TypeVar("P", ClusterProbe, MasterProbe)


def merge_samples(samples: Sequence[ClusterProbe]) -> ClusterProbe:
    """One probe whose every figure is the median of `samples`' (probes of one cluster,
    one key). It carries the newest sample's key, identity and time, and in
    ``samples_created`` when each sample was taken; one sample is returned as it is."""
    samples = _newest_last(samples, "clusters")
    newest = samples[-1]
    if len(samples) == 1:
        return newest
    names = [w.name for w in newest.workers]
    workers = [_worker([w for p in samples for w in p.workers if w.name == name])
               for name in names]
    return replace(newest, workers=workers, store=_store([p.store for p in samples]),
                   dask=_dask([p.dask for p in samples]),
                   master=_master([p.master for p in samples]),
                   seconds=sum(p.seconds for p in samples),
                   samples_created=sorted(t for p in samples for t in p.created_times()))


def merge_master_samples(samples: Sequence[MasterProbe]) -> MasterProbe:
    """As `merge_samples`, of probes of this process training the whole network
    (``strategy: reference``): its dense head's and every layer's medians."""
    samples = _newest_last(samples, "processes")
    if len(samples) == 1:
        return samples[0]
    return replace(_master(samples), created=samples[-1].created,
                   samples_created=sorted(t for p in samples for t in p.created_times()))


def _newest_last(samples: Sequence[P], what: str) -> list[P]:
    """`samples` oldest first, checked to be samples of one probe (one key)."""
    if not samples:
        raise ValueError("no probe samples to merge")
    if len({p.key for p in samples}) != 1:
        raise ValueError(f"probe samples of different {what} cannot be merged")
    return sorted(samples, key=lambda p: p.created)


def _middle(values: Sequence[float | None]) -> float | None:
    """The median of the values given (None where none is)."""
    present = [v for v in values if v is not None]
    return median(present) if present else None


def _medians(records: Sequence[T], names: Sequence[str]) -> dict[str, Any]:
    """Field -> median over `records`, for the numeric fields `names`."""
    return {name: _middle([getattr(r, name) for r in records]) for name in names}


def _spread(spreads: Sequence[dict[int, float]]) -> dict[int, float]:
    """Per number of workers running, the median spread of the samples that measured it."""
    counts = sorted({k for s in spreads for k in s})
    return {k: median([s[k] for s in spreads if k in s]) for k in counts}


def _matched(lists: Sequence[Sequence[T]], key: Callable[[T], Any]) -> list[list[T]]:
    """The entries of several samples' lists grouped by `key`, in first-seen order."""
    groups: dict[Any, list[T]] = {}
    for entries in lists:
        for entry in entries:
            groups.setdefault(key(entry), []).append(entry)
    return list(groups.values())


def _timings(lists: Sequence[Sequence[ShardTiming]]) -> list[ShardTiming]:
    merged = []
    for group in _matched(lists, lambda t: (t.layer, t.kernels, t.active)):
        figures = _medians(group, ("forward_s", "backward_s", "input_grad_s", "low_s",
                                   "high_s", "dataset_s"))
        merged.append(replace(group[0], **figures,
                              rounds=sum(t.rounds for t in group),
                              steps=sum(t.steps for t in group),
                              settled=all(t.settled for t in group),
                              outlier=2 * sum(t.outlier for t in group) > len(group)))
    return merged


def _trunk(trunks: Sequence[TrunkTiming | None]) -> TrunkTiming | None:
    """The median trunk of the samples that timed one at the newest's rows and workers."""
    present = [t for t in trunks if t is not None]
    if not present:
        return None
    alike = [t for t in present if (t.rows, t.active) == (present[-1].rows, present[-1].active)]
    figures = _medians(alike, ("forward_s", "backward_s", "low_s", "high_s", "dataset_s",
                               "dense_s", "data_step_s", "update_s"))
    return replace(alike[0], **figures, rounds=sum(t.rounds for t in alike),
                   steps=sum(t.steps for t in alike), settled=all(t.settled for t in alike))


def _worker(probes: Sequence[WorkerProbe]) -> WorkerProbe:
    return replace(probes[-1], timings=_timings([w.timings for w in probes]),
                   trunk=_trunk([w.trunk for w in probes]),
                   spread=_spread([w.spread for w in probes]),
                   memory_bw=_middle([w.memory_bw for w in probes]))


def _store(stores: Sequence[StoreProbe]) -> StoreProbe:
    return replace(stores[-1], **_medians(stores, ("read_latency_s", "read_bw",
                                                   "write_latency_s", "write_bw",
                                                   "dataset_read_s")),
                   spread=_spread([s.spread for s in stores]))


def _dask(probes: Sequence[DaskProbe]) -> DaskProbe:
    """Medians of the orchestration costs; the client's share of the cores is figured
    again from every sample's rounds together (`median_share`), not as a median
    of the samples' own shares: a sample whose rounds were too spread to give one
    still adds them, and so does one taken where no share is measured (none)."""
    numeric = [f.name for f in fields(DaskProbe)
               if f.name not in ("scheduler_here", "host_cores", "contention_share",
                                 "contention_shares")]
    shares = [s for p in probes for s in p.contention_shares]
    return replace(probes[-1], **_medians(probes, numeric), contention_shares=shares,
                   contention_share=median_share(shares))


def _master(probes: Sequence[MasterProbe]) -> MasterProbe:
    return replace(probes[-1], **_medians(probes, ("dense_s", "dense_low_s", "dense_high_s",
                                                   "dataset_read_s")),
                   timings=_timings([p.timings for p in probes]))
