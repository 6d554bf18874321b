"""Reading a step's batch from the dataset: as the probe timed it, where it did.

Every holder of the first conv layer reads the whole batch (``kernel``); a replica
reads its rows (``data``, ``hybrid``). Over a network file system a batch read is a
round trip per row, and its seconds depend on what the other workers do meanwhile
(the round trips are CPU on the same cores): one plan of the probe read 64 rows in
16 ms, another in 38 ms (docs/model.md, "Batch reads"). So where the probe timed a
device's read in the runs that timed its shard (`LayerTable.dataset`) or its trunk
(`TrunkTime.dataset`), that figure is the model's; elsewhere the dataset store's
(`Options.dataset`: one median read, or a store's latency and bandwidth).
"""

from __future__ import annotations

from .devices import DeviceSpec, LinkSpec, StoreSpec
from .network import Network
from .timeline import io_time

__all__ = ["batch_bytes", "shard_batch_read", "replica_batch_read"]


def batch_bytes(network: Network, batch: int, s: int = 4) -> float:
    """Bytes of one batch as the dataset holds it: images and int64 labels."""
    first = network.conv[0]
    return batch * (first.in_channels * first.in_hw[0] * first.in_hw[1] * s + 8)


def _store_read(link: LinkSpec, dataset: StoreSpec, network: Network, rows: int,
                s: int) -> float:
    return io_time(link, dataset, batch_bytes(network, rows, s), 1, "read")


def shard_batch_read(device: DeviceSpec, link: LinkSpec, dataset: StoreSpec | None,
                     network: Network, batch: int, kernels: int) -> float:
    """A holder of ``kernels`` kernels of the first layer reading the whole batch
    (0 without a dataset to read)."""
    if dataset is None:
        return 0.0
    table = device.layer_tables.get(network.conv[0].name)
    timed = table.dataset_time(kernels, batch) if table is not None else None
    if timed is not None:
        return timed
    return _store_read(link, dataset, network, batch, device.bytes_per_elem)


def replica_batch_read(device: DeviceSpec, link: LinkSpec, dataset: StoreSpec | None,
                       network: Network, rows: int) -> float:
    """A replica reading its ``rows`` of the batch (0 without a dataset, or rows)."""
    if dataset is None or rows <= 0:
        return 0.0
    timed = device.trunk.dataset_time(rows) if device.trunk is not None else None
    if timed is not None:
        return timed
    return _store_read(link, dataset, network, rows, device.bytes_per_elem)
