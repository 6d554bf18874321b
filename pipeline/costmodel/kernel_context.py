"""What the simulation of one kernel-parallel step works from (kernel.py, and the same
step on the fast timeline, kernel_fast.py): the network, the batch, the devices and
how many kernels of each conv layer each holds, and where the slices go."""

from __future__ import annotations

from dataclasses import dataclass

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
        return [d for d, k in enumerate(self.counts[l]) if k > 0]

    def slice_bytes(self, l: int, d: int) -> float:
        """Bytes of device ``d``'s share of conv layer ``l``'s pooled output."""
        return self.network.conv[l].output_elements(self.batch, self.counts[l][d]) * self.s
