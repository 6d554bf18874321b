"""A synchronised batch norm's compute against a local one's, layer by layer.

``python -m benchmarks.sync_batch_norm [--network resnet20] [--rows 64] [--repeats 30]``

Under ``train.batch_norm: sync`` a replica's batch norms take the whole batch's
statistics (tasks/sync_batch_norm.py): their forward and backward run passes of their
own over each layer's tensors (its partial sums, the normalisation with the combined
statistics, the input gradient from the combined sums), where ``local`` runs PyTorch's
fused training-mode kernels. This times both on one thread, forward and backward, at
every batch-norm layer's shape of `--network` with `--rows` rows (a replica's share
of the batch): ``local`` is nn.BatchNorm2d in training mode; ``sync`` is the same
module made a `ReplicaBatchNorm2d` that exchanges with no peer (one replica, slots in
memory), so that only its compute is timed, not a wait. Each figure is the median of
`--repeats` calls, the two timed in turn; the last line sums the layers, a step's
batch norms on one replica.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from tasks.receipts import Receipt, TaskClock
from tasks.sync_batch_norm import BatchNormExchange, ComputeSpans, exchanging, synchronise
from tasks.zoo import build_preset


class OwnSlots:
    """One replica's slots: what it writes, it reads back (no peer, no wait)."""

    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}

    def write(self, slot: str, step: int, tensor: torch.Tensor, clock: TaskClock) -> None:
        self.values[slot] = tensor

    def read(self, slot: str, step: int, clock: TaskClock) -> torch.Tensor:
        return self.values[slot]


class OneNorm(nn.Module):
    """A single batch norm as `synchronise` expects a network: its ``norms``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(channels)
        self.norms = [self.norm]


def elapsed_ms(run) -> float:
    """Milliseconds of one call of `run`."""
    start = time.perf_counter()
    run()
    return 1e3 * (time.perf_counter() - start)


def time_layer(channels: int, height: int, width: int, rows: int, repeats: int
               ) -> tuple[float, float]:
    """Milliseconds of one forward and backward, local and synchronised."""
    x = torch.randn(rows, channels, height, width) * 2 + 0.5
    dy = torch.randn_like(x)
    local = nn.BatchNorm2d(channels).train()
    synced = OneNorm(channels).train()
    (norm,) = synchronise(synced)
    slots = OwnSlots()

    def run_local() -> None:
        leaf = x.detach().requires_grad_(True)
        local(leaf).backward(dy)

    def run_synced() -> None:
        leaf = x.detach().requires_grad_(True)
        clock = TaskClock(Receipt("bench", "w0", 0, 0.0))  # the phases it records
        with clock.op("replica-step"), ComputeSpans(clock) as spans, \
                exchanging([norm], BatchNormExchange(slots, 0, 1, 0, spans)):
            norm(leaf).backward(dy)

    for run in (run_local, run_synced):  # warm-up
        run()
    local_ms, synced_ms = [], []
    for _ in range(repeats):  # in turn, so that a slow moment of the machine hits both
        local_ms.append(elapsed_ms(run_local))
        synced_ms.append(elapsed_ms(run_synced))
    return statistics.median(local_ms), statistics.median(synced_ms)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--network", default="resnet20", help="a zoo preset with batch norm")
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--rows", type=int, default=64, help="a replica's rows")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    small = args.network in ("resnet20", "marques")
    shape, classes = ((3, 32, 32), 10) if small else ((3, 224, 224), 1000)
    spec = build_preset(args.network, shape, classes, "float32", args.width)
    shapes = [(c.kernels, c.conv_height, c.conv_width) for c in spec.conv if c.batch_norm]
    if not shapes:
        raise SystemExit(f"{args.network} has no batch norm")
    print(f"{args.network} x{args.width}, {args.rows} rows, one thread, torch "
          f"{torch.__version__}: forward + backward, median of {args.repeats}")
    total_local = total_synced = 0.0
    for channels, height, width in sorted(set(shapes), reverse=True):
        count = shapes.count((channels, height, width))
        local_ms, synced_ms = time_layer(channels, height, width, args.rows, args.repeats)
        total_local += count * local_ms
        total_synced += count * synced_ms
        print(f"  {count:2d} x {channels:4d} ch {height:3d}x{width:<3d}  local {local_ms:7.3f} ms  "
              f"sync {synced_ms:7.3f} ms  ({synced_ms / local_ms:.2f}x)")
    print(f"every batch norm once: local {total_local:.1f} ms, sync {total_synced:.1f} ms "
          f"({total_synced / total_local:.2f}x)")


if __name__ == "__main__":
    main()
