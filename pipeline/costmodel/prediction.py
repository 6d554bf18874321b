"""Options of a prediction and its result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, TypeVar

from .devices import DaskOverhead, StoreSpec

__all__ = ["Options", "Prediction", "split_batch", "taking_part", "layer_quantum",
           "BATCH_NORMS"]

T = TypeVar("T")

#: How replicas take batch norm's statistics (`Options.batch_norm`).
BATCH_NORMS = ("sync", "local")


@dataclass(frozen=True)
class Options:
    """Knobs of :func:`~pipeline.costmodel.strategies.predict`.

    Attributes
    ----------
    kernel_counts : sequence of sequence of int, optional
        ``k[l][d]`` for ``kernel``: kernels of conv layer ``l`` on device
        ``d``; each row sums to the layer's output channels.
    split : str
        How ``kernel`` splits when no counts are given: ``"proportional"``
        or ``"minmax"``.
    quantum : int or sequence of int
        Kernel counts are multiples of this (a Zarr chunk's channels); a
        store access touches one chunk per ``quantum`` channels.  One value
        per conv layer where layers are chunked differently.
    dataset : StoreSpec, optional
        Where the batch is read from (the first conv layer's input, the
        master's labels, a single device's step); ``None``: ``kernel``
        reads layer 1's input from the workspace store and ``single``
        reads nothing.
    min_units : int
        ``split="minmax"``: quanta every device must hold (the engine runs a
        task per worker and layer, so it needs at least one).
    master : int
        Index of the device that runs the dense head (``kernel``).
    overhead : DaskOverhead, optional
        Task, marker and hop latencies of the engine (``kernel``); ``None``: none.
    sync : str
        ``kernel``: how a reader waits for a writer, ``"markers"`` (polling the
        workspace; ``overhead.sync``) or ``"scheduler"`` (``overhead.hop``).
    allreduce : str
        ``"ring"`` or ``"rhd"`` for weight-gradient allreduce.
    overlap : bool
        Overlap the gradients' allreduce with the backward pass, a bucket of layers
        at a time.
    bucket_mb : float
        With ``overlap``: the least MiB of gradients an allreduce carries (PyTorch
        DDP's ``bucket_cap_mb``, 25 there); 0: one allreduce per layer.
    batch_split : str
        ``"equal"`` (``B/p`` each) or ``"proportional"`` to conv rate, for
        ``data`` and the conv part of ``hybrid``.
    batch_shares : sequence of int, optional
        ``data`` / ``hybrid``: the samples each device gets (overrides
        ``batch_split``; a run's recorded split).
    dense_split : sequence of sequence of int, optional
        ``hybrid`` with a store: output neurons of dense layer ``j`` per
        device taking part (given a sample); default, or given for another
        number of devices, as even as can be over those.
    scheme : str
        ``hybrid`` feeding of the dense layers: ``"a"`` all-gather, ``"b"``
        broadcast in turn, ``"c"`` all-to-all.
    dense_batch : str
        ``hybrid``: ``"worker"`` (dense batch = one worker's conv batch,
        weights updated after every sub-step) or ``"full"`` (the whole
        batch, one update).
    broadcast : str
        ``hybrid`` scheme (b): ``"binomial"`` or ``"linear"`` broadcast and
        matching reduce of the returned gradients.
    overlap_dense : bool
        ``hybrid`` schemes (b)/(c): send the next part while the dense
        layers work on the current one.
    batch_norm : str
        ``data`` and ``hybrid``: ``"sync"`` (batch norm's statistics over the whole
        batch: two small exchanges per batch-norm layer and step, forward and
        backward) or ``"local"`` (each replica's own rows: no exchange), as the run's
        ``train.batch_norm``.
    timeline : str
        ``kernel``, and ``data`` and ``hybrid`` through a store: ``"auto"``
        computes the step's timeline a phase of all devices at a time where that is
        exact (every device on one link; timeline_fast.py), ``"reference"`` always
        simulates it op by op (timeline.py), as tests and benchmarks compare.
    """

    kernel_counts: Sequence[Sequence[int]] | None = None
    split: str = "proportional"
    quantum: int | Sequence[int] = 1
    dataset: StoreSpec | None = None
    min_units: int = 0
    master: int = 0
    overhead: DaskOverhead | None = None
    sync: str = "markers"
    allreduce: str = "ring"
    overlap: bool = False
    bucket_mb: float = 0.0
    batch_split: str = "equal"
    batch_shares: Sequence[int] | None = None
    dense_split: Sequence[Sequence[int]] | None = None
    scheme: str = "b"
    dense_batch: str = "worker"
    broadcast: str = "binomial"
    overlap_dense: bool = True
    batch_norm: str = "sync"
    timeline: str = "auto"

    def __post_init__(self) -> None:
        if self.batch_norm not in BATCH_NORMS:
            raise ValueError(f"batch_norm {self.batch_norm!r}: expected one of {BATCH_NORMS}")


@dataclass
class Prediction:
    """Predicted step of one strategy.

    Attributes
    ----------
    strategy : str
        ``single``, ``kernel``, ``data`` or ``hybrid``.
    step_time : float
        Seconds per training step.
    batch : int
        Samples per step.
    breakdown : dict
        Seconds: ``compute`` (list, per device, all its work),
        ``compute_max``, and the critical path split into
        ``compute_critical`` (compute outside the dense head: the conv
        trunk, or the whole replica for ``data``), ``master`` (dense head,
        or the dense phase's compute for ``hybrid``), ``communication``
        (link time not hidden), ``storage`` (store I/O) and ``overhead``
        (Dask); these five add up to ``step_time``, and ``contention`` (the
        client's share of the cores, pipeline/costmodel/contention.py) where
        a run's prediction adds it.
    kernel_counts : list of list of int, optional
        The split used by ``kernel``.
    details : dict
        Strategy-specific extras (per-layer phases, bytes moved).
    """

    strategy: str
    step_time: float
    batch: int
    breakdown: dict[str, Any]
    kernel_counts: list[list[int]] | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.batch / self.step_time if self.step_time > 0 else float("inf")


def layer_quantum(quantum: int | Sequence[int], layer: int) -> int:
    """The quantum of conv layer ``layer`` from one value or a per-layer sequence."""
    if isinstance(quantum, int):
        return max(quantum, 1)
    return max(int(quantum[layer]), 1)


def split_batch(batch: int, weights: Sequence[float]) -> list[int]:
    """Split ``batch`` samples in proportion to ``weights``, summing exactly.

    Largest-remainder rounding, so equal weights give ``B/p`` each (the
    first ``B mod p`` devices one more).
    """
    total = float(sum(weights))
    raw = [batch * w / total for w in weights]
    base = [int(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - base[i]), i))
    for i in order[: batch - sum(base)]:
        base[i] += 1
    return base


def taking_part(devices: Sequence[T], shares: Sequence[int]) -> tuple[list[T], list[int]]:
    """The devices given samples, and their shares. A replica given none leaves the run,
    as the engine's do (pipeline/strategies/replicas.py), so it takes no part in the
    all-reduce or the dense layers: a split in proportion to speed gives a device far
    slower than the others none where the batch is short."""
    kept = [i for i, n in enumerate(shares) if n > 0]
    return [devices[i] for i in kept], [shares[i] for i in kept]
