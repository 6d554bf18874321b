"""Devices, links, the shared store and Dask overheads as plain numbers.

Compute follows Castelló et al.'s roofline: an ``m x n x k`` product costs
``max(2mnk / R, s (mn + mk + nk) / M)``; ``R`` is a peak rate scaled by a
Paleo-style efficiency per layer kind (Qi et al., ICLR 2017), or a rate
calibrated for one named layer.  Links follow Hockney: ``alpha + n beta``
(``+ n gamma`` where bytes are reduced).

Where a device's conv layers were timed at their real shapes
(:class:`LayerTable`), the measured seconds replace the roofline: on CPUs the
time of a shard is far from linear in its kernel count (oneDNN works in
blocks of 8-16 output channels and pays for the input transform whatever the
count), so a single FLOP rate mispredicts small shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import groupby
from typing import Mapping, Sequence

from .layer_table import LayerTable
from .network import Gemm

__all__ = ["LinkSpec", "LayerTable", "TrunkTime", "DeviceSpec", "StoreSpec", "DaskOverhead", "IDEAL_LINK",
           "distinct", "spreads", "uneven"]

INF = math.inf


@dataclass(frozen=True)
class LinkSpec:
    """Hockney point-to-point link.

    Attributes
    ----------
    alpha : float
        Latency per message, s.
    beta : float
        Transfer time per byte, s/B (inverse bandwidth).
    gamma : float
        Reduction arithmetic per byte, s/B.
    """

    alpha: float = 0.0
    beta: float = 0.0
    gamma: float = 0.0

    @classmethod
    def from_bandwidth(
        cls, bandwidth: float, latency: float = 0.0, reduce_bandwidth: float = INF
    ) -> "LinkSpec":
        """Build from bandwidths in B/s (``inf`` gives a zero term)."""
        return cls(alpha=latency, beta=1.0 / bandwidth, gamma=1.0 / reduce_bandwidth)

    @property
    def bandwidth(self) -> float:
        """Bandwidth in B/s."""
        return INF if self.beta == 0 else 1.0 / self.beta

    def time(self, n_bytes: float, messages: int = 1) -> float:
        """``messages * alpha + n_bytes * beta``; zero bytes and messages cost zero."""
        return messages * self.alpha + n_bytes * self.beta

    @staticmethod
    def slowest(links: "list[LinkSpec]") -> "LinkSpec":
        """Worst of each term: a ring or tree runs at its slowest link."""
        return LinkSpec(
            alpha=max(l.alpha for l in links),
            beta=max(l.beta for l in links),
            gamma=max(l.gamma for l in links),
        )


IDEAL_LINK = LinkSpec()


@dataclass(frozen=True)
class TrunkTime:
    """Measured seconds of a whole conv trunk (every conv layer, every kernel) as a
    ``data`` or ``hybrid`` replica runs it: one autograd pass over ``batch`` rows,
    with the other replicas running at the same time.

    Where a device has one, replicas take its forward and backward (scaled linearly
    in the rows: the products are linear in the batch) instead of the sum of its
    layer tables, which were timed on kernel shards at another batch and, for the
    whole layer, with no other worker busy. Likewise its batch read (``dataset``),
    timed as the replicas read their rows at once.
    """

    batch: int
    forward: float
    backward: float
    dataset: float | None = None  # the replica's batch read, timed in the same runs
    #: the dense head's forward and backward on ``batch`` rows, every replica at once
    #: (None: not measured; the dense rate stands)
    dense: float | None = None
    #: a ``data`` replica's whole step on ``batch`` rows (trunk and head, forward and
    #: backward, its gradient's hand-on copies), every replica at once: the same
    #: layers run a few percent faster in ``data``'s one autograd pass than in
    #: ``hybrid``'s trunk ops (None: not measured; trunk and head stand)
    data_step: float | None = None
    #: a ``hybrid`` device's dense ops (its neurons of every dense layer, forward and
    #: backward) on ``hybrid_head_batch`` rows, the whole batch, as its runs run them,
    #: every device at once (None: not measured; the dense head's figure stands)
    hybrid_head: float | None = None
    hybrid_head_batch: int = 0

    def data_step_time(self, batch: float) -> float | None:
        """Seconds of a ``data`` replica's step on ``batch`` rows (``None``: not timed)."""
        if self.data_step is None or batch <= 0:
            return None
        return self.data_step * batch / self.batch

    def dense_time(self, batch: float) -> float | None:
        """Seconds of the dense head on ``batch`` rows (in proportion to the rows timed;
        ``None``: not timed)."""
        if self.dense is None or batch <= 0:
            return None
        return self.dense * batch / self.batch

    def times(self, batch: float) -> tuple[float, float]:
        """``(forward, backward)`` seconds of the trunk on ``batch`` rows."""
        if batch <= 0:
            return 0.0, 0.0
        return self.forward * batch / self.batch, self.backward * batch / self.batch

    def dataset_time(self, batch: float) -> float | None:
        """Seconds of reading ``batch`` rows from the dataset (``None``: not timed)."""
        if self.dataset is None or batch <= 0:
            return None
        return self.dataset * batch / self.batch


@dataclass(frozen=True)
class DeviceSpec:
    """One compute device (a CPU process or a GPU).

    Attributes
    ----------
    flops : float
        Peak arithmetic rate, FLOP/s.
    mem_bw : float
        Memory bandwidth, B/s (``inf``: never memory-bound).
    bytes_per_elem : int
        ``s`` of the roofline (4 for float32).
    conv_efficiency, dense_efficiency : float
        Fraction of ``flops`` reached on conv / dense products (Paleo's
        efficiency factor).
    mem_efficiency : float
        Fraction of ``mem_bw`` reached by streaming kernels.
    layer_rates : mapping of str to float
        Calibrated effective FLOP/s for named layers; overrides the roofline
        for those layers (the measurement already holds memory effects).
    layer_tables : mapping of str to LayerTable
        Measured shard times of named conv layers; where present they
        replace rate and roofline for that layer's conv time (the rate,
        if also given, still drives proportional splits).
    trunk : TrunkTime or None
        The whole conv trunk measured as a replica runs it (``data``,
        ``hybrid``); where present, replicas' conv time totals it.
    link : LinkSpec or None
        The device's own connection (to peers or to the store); ``None``:
        use the link given to ``predict``.
    name : str
        Label.
    spread : float
        Its compute time's coefficient of variation from step to step (0: steady):
        what the timeline's waits for it cost beyond the mean (timeline.py).
    update_bw : float or None
        Bytes per second of a replica's update (its gathered flat gradient and SGD
        step), from the engine's own update timed in the probe: the update streams
        faster per access than the memory rate's passes (VGG-11/4's ran 13 ms where
        the memory rate priced 17). ``None``: the memory rate.
    """

    flops: float
    mem_bw: float = INF
    bytes_per_elem: int = 4
    conv_efficiency: float = 1.0
    dense_efficiency: float = 1.0
    mem_efficiency: float = 1.0
    layer_rates: Mapping[str, float] = field(default_factory=dict)
    layer_tables: Mapping[str, LayerTable] = field(default_factory=dict)
    link: LinkSpec | None = None
    name: str = ""
    trunk: TrunkTime | None = None
    spread: float = 0.0
    update_bw: float | None = None

    @classmethod
    def from_rates(
        cls,
        conv_rate: float,
        dense_rate: float | None = None,
        mem_bw: float = INF,
        link: LinkSpec | None = None,
        name: str = "",
    ) -> "DeviceSpec":
        """A device given its effective conv (and dense) FLOP/s directly."""
        dense_eff = 1.0 if dense_rate is None else dense_rate / conv_rate
        return cls(flops=conv_rate, mem_bw=mem_bw, dense_efficiency=dense_eff, link=link, name=name)

    def rate(self, kind: str = "conv", layer: str | None = None) -> float:
        """Effective FLOP/s for a layer kind (``"conv"`` or ``"dense"``)."""
        if layer is not None and layer in self.layer_rates:
            return self.layer_rates[layer]
        eff = self.conv_efficiency if kind == "conv" else self.dense_efficiency
        return self.flops * eff

    def gemm_time(self, gemm: Gemm, kind: str = "conv", layer: str | None = None) -> float:
        """Roofline time ``max(2mnk/R, s(mn+mk+nk)/M)`` of one product."""
        if gemm.macs <= 0:
            return 0.0
        if layer is not None and layer in self.layer_rates:
            return gemm.flops / self.layer_rates[layer]
        compute = gemm.flops / self.rate(kind)
        memory = self.bytes_per_elem * gemm.elements() / (self.mem_bw * self.mem_efficiency)
        return max(compute, memory)

    def stream_time(self, elements: float) -> float:
        """Time to stream ``elements`` through memory once (element-wise ops)."""
        return self.bytes_per_elem * elements / (self.mem_bw * self.mem_efficiency)

    def update_time(self, elements: float) -> float:
        """Time of a replica's update making ``elements`` element accesses: at the
        measured update rate where there is one, else as a stream."""
        if self.update_bw is None:
            return self.stream_time(elements)
        return self.bytes_per_elem * elements / self.update_bw


@dataclass(frozen=True)
class StoreSpec:
    """The shared Zarr workspace that activations and gradients go through.

    Attributes
    ----------
    write_bw, read_bw : float
        Aggregate bandwidth of the store, B/s: concurrent writers (readers)
        share it, so a phase lasts at least its total bytes over this.
    latency : float
        Per-operation cost, s (one array access: open, metadata).
    client_write_bw, client_read_bw : float or None
        What one client can reach alone; ``None``: the aggregate.
    read_chunk, write_chunk : float
        Cost per chunk an access touches, s (a file per chunk on a local
        Zarr store); how many chunks an access touches comes from the
        kernel split's quantum (one chunk per ``quantum`` channels).
    spread : float
        One access's time's coefficient of variation from access to access (0:
        steady). Each access adds it to the accessing device's clock as a
        compute op adds `DeviceSpec.spread` (timeline.py): workers meet at
        every slot, and where the accesses are most of the step (a workspace
        over sshfs), their spread is most of what the meetings wait for.
    """

    write_bw: float
    read_bw: float
    latency: float = 0.0
    client_write_bw: float | None = None
    client_read_bw: float | None = None
    read_chunk: float = 0.0
    write_chunk: float = 0.0
    spread: float = 0.0

    def chunk_cost(self, direction: str) -> float:
        """Seconds per chunk touched, ``"read"`` or ``"write"``."""
        return self.read_chunk if direction == "read" else self.write_chunk

    def client_bw(self, direction: str) -> float:
        """Single-client bandwidth for ``"read"`` or ``"write"``."""
        if direction == "read":
            return self.client_read_bw or self.read_bw
        return self.client_write_bw or self.write_bw

    def aggregate_bw(self, direction: str) -> float:
        """Shared bandwidth for ``"read"`` or ``"write"``."""
        return self.read_bw if direction == "read" else self.write_bw


@dataclass(frozen=True)
class DaskOverhead:
    """What running a step as Dask tasks adds to it (the engine's orchestration).

    Attributes
    ----------
    task : float
        Gap between the end of one of a worker's tasks and the start of its next
        one, already queued (dispatch and receipt), s.
    sync : float
        Latency from a slot's ready marker to its waiting reader noticing it
        (``sync: markers``; the reader polls), s.
    hop : float
        Latency of a Dask dependency: from one task's end to a dependent task's
        start through the scheduler (``sync: scheduler``), s.
    check : float or None
        A reader's look at the marker of a slot written before it came (``None``:
        ``sync``, as long as noticing). On a local disk the look took 0.02-0.07 ms
        where noticing took 0.07-0.23 ms (AMD EPYC, 2026-11-30); over sshfs both are
        a round trip, 2.4-2.7 ms.
    """

    task: float = 0.0
    sync: float = 0.0
    hop: float = 0.0
    check: float | None = None

    @property
    def marker_check(self) -> float:
        """Seconds of every marked read's look at its slot's marker (`check`)."""
        return self.sync if self.check is None else self.check

    @property
    def notice_lag(self) -> float:
        """How much later than a slot's write a reader that waited for it reads it
        than one that finds it written: noticing less the look both take."""
        return max(self.sync - self.marker_check, 0.0)


def distinct(devices: Sequence[DeviceSpec]) -> tuple[list[DeviceSpec], list[int]]:
    """The distinct devices, and for each device the index of its equal among them.

    Models time equal devices' work once: scaling sweeps pass thousands of equal
    devices (often one object), and a device spec is not hashable (its tables are
    mappings), so equals are found by identity first, then by comparison.
    """
    kinds: list[DeviceSpec] = []
    kind_of: list[int] = []
    seen: dict[int, int] = {}  # id of a device object met before -> its index
    for _, same in groupby(devices, key=id):  # a run of one object: one look-up
        run = list(same)
        dev = run[0]
        index = seen.get(id(dev))
        if index is None:
            index = next((i for i, k in enumerate(kinds) if k is dev or k == dev), None)
        if index is None:
            kinds.append(dev)
            index = len(kinds) - 1
        seen[id(dev)] = index
        kind_of += [index] * len(run)
    return kinds, kind_of


def spreads(devices: Sequence[DeviceSpec]) -> tuple[float, ...]:
    """The devices' `DeviceSpec.spread`, for a `Timeline`; empty where none varies
    (then the fast timelines, which keep no variances, give the same step)."""
    values = tuple(device.spread for device in devices)
    return values if any(values) else ()


def uneven(devices: Sequence[DeviceSpec], store: StoreSpec | None) -> bool:
    """Whether a timeline's clocks carry variances: a device's compute spread or the
    store's access spread. The fast timelines keep none, so they apply only where not."""
    return bool(spreads(devices)) or (store is not None and store.spread > 0)
