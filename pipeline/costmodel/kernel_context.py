"""What the simulation of one kernel-parallel step works from (kernel.py, and the same
step on the fast timeline, kernel_fast.py): the network, the batch, the devices and
how many kernels of each conv layer each holds, and where the slices go.

The engine's ops follow the network's layer graph (tasks/kernel_ops.py): a layer reads
the whole output of its source layer (`Network.source`), gathered once per device at
the first layer it holds that reads it (its shards joined into the whole:
`gather_time`); a layer's output goes to every holder of each layer reading it (and to
the master, for the last layer); its gradient is the sum of the partial input
gradients of every reader's holders, the residual gradients of the layers adding it
(local: tied splits) and, for the last layer, the head's slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .compute import GATHER_ACCESSES
from .devices import DaskOverhead, DeviceSpec, LinkSpec, StoreSpec
from .network import Network

__all__ = ["KernelContext"]


@dataclass(frozen=True)
class KernelContext:
    """Everything the simulation of a kernel-parallel step needs."""

    network: Network
    batch: int
    devices: tuple[DeviceSpec, ...]
    link: LinkSpec
    store: StoreSpec | None
    counts: tuple[tuple[int, ...], ...]
    master: int = 0
    dataset: StoreSpec | None = None
    overhead: DaskOverhead = DaskOverhead()
    sync: str = "markers"

    def link_of(self, d: int) -> LinkSpec:
        """Device ``d``'s own link, else the shared one."""
        return self.devices[d].link or self.link

    @property
    def s(self) -> int:
        return self.devices[0].bytes_per_elem

    def holders(self, l: int) -> list[int]:
        """The devices holding kernels of layer ``l``, in device order (do not modify)."""
        return self._holders[l]

    def slice_bytes(self, l: int, d: int) -> float:
        """Bytes of device ``d``'s share of conv layer ``l``'s pooled output."""
        return self.network.conv[l].output_elements(self.batch, self.counts[l][d]) * self.s

    @cached_property
    def _held(self) -> np.ndarray:
        """Whether each device (columns) holds kernels of each layer (rows)."""
        return np.array(self.counts, dtype=np.int64).reshape(len(self.counts), -1) > 0

    @cached_property
    def _holders(self) -> tuple[list[int], ...]:
        return tuple(np.flatnonzero(row).tolist() for row in self._held)

    @cached_property
    def readers(self) -> tuple[tuple[int, ...], ...]:
        """Per conv layer, the layers reading its whole output, in layer order."""
        return tuple(tuple(self.network.readers(l)) for l in range(len(self.network.conv)))

    @cached_property
    def gatherers(self) -> tuple[np.ndarray, ...]:
        """Per conv layer, its holders that gather its source's output at its forward
        (those holding no earlier layer that reads the same source: they reuse that),
        in device order."""
        seen: dict[int, np.ndarray] = {}
        out = []
        for l, held in enumerate(self._held):
            src = self.network.source(l)
            mine = held & ~seen[src] if src in seen else held
            seen[src] = seen[src] | mine if src in seen else mine
            out.append(np.flatnonzero(mine))
        return tuple(out)

    @cached_property
    def output_readers(self) -> tuple[np.ndarray, ...]:
        """Per conv layer, the devices reading its output: every holder of each layer
        reading it, and the master for the last layer; in device order."""
        last = len(self.network.conv) - 1
        out = []
        for l, readers in enumerate(self.readers):
            reads = np.zeros(len(self.devices), dtype=bool)
            for r in readers:
                reads |= self._held[r]
            if l == last:
                reads[self.master] = True
            out.append(np.flatnonzero(reads))
        return tuple(out)

    def summing_elements(self, l: int, kernels: float) -> float:
        """Element accesses of summing a holder's gradient parts of layer ``l``'s output
        (`gradient_parts`) on ``kernels`` channels: read each, write the sum (none for
        a single part), as a replica's autograd sums them (`data.GRADIENT_SUM`)."""
        parts = self.gradient_parts(l)
        if parts <= 1:
            return 0.0
        return (parts + 1) * self.network.conv[l].output_elements(self.batch, kernels)

    def summing_time(self, dev: DeviceSpec, l: int, kernels: float) -> float:
        """Seconds of `summing_elements` on ``dev``; none where ``dev`` has layer ``l``'s
        measured table: the probe times a shard's backward with its sum of the parts."""
        if self.network.conv[l].name in dev.layer_tables:
            return 0.0
        return dev.stream_time(self.summing_elements(l, kernels))

    def gather_time(self, dev: DeviceSpec, l: int) -> float:
        """Seconds of ``dev`` joining the shards of conv layer ``l``'s output into the
        whole (``torch.cat`` along channels: `GATHER_ACCESSES` a element), where more
        than one device holds it; none where one does (its output is used as it is).
        The engine does this between the gather's reads and the compute of the layer
        reading it (and on the master before the dense head), outside any phase the
        probe times, so a table of measured shard times does not hold it."""
        if l < 0 or len(self.holders(l)) < 2:
            return 0.0
        return dev.stream_time(GATHER_ACCESSES * self.network.conv[l].output_elements(self.batch))

    def gradient_parts(self, l: int) -> int:
        """Tensors summed into a holder's gradient of layer ``l``'s output: one partial
        per holder of each reader, one residual gradient per adder, the head's slice."""
        return (sum(len(self.holders(r)) for r in self.readers[l])
                + len(self.network.adders(l)) + (l == len(self.network.conv) - 1))
