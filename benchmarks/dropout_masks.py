"""What a `data` replica's dropout costs a step: its `SeededDropout` modules (one per
dense layer with dropout) drawing their masks and masking the replica's rows of the
batch, as ``replica-step`` runs them, on one thread. Median of `--repeats` steps,
each its own step number (its own masks).

    python -m benchmarks.dropout_masks --width 1024 --layers 2 --batch 128 --replicas 2
    python -m benchmarks.dropout_masks --width 4096 --layers 2 --batch 256 --replicas 4
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from tasks.network import SeededDropout, set_dropout


def replica_dropout_seconds(width: int, layers: int, batch: int, replicas: int,
                            repeats: int, p: float = 0.5) -> float:
    """Median seconds of the first replica's dropout over `layers` inputs `width` wide."""
    model = torch.nn.Sequential(*[SeededDropout(p, j) for j in range(layers)]).train()
    rows = batch // replicas
    x = torch.ones(rows, width)
    times = []
    for step in range(repeats):
        set_dropout(model, 0, step, slice(0, rows), batch)
        start = time.perf_counter()
        model(x)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=31)
    args = parser.parse_args()
    torch.set_num_threads(1)
    seconds = replica_dropout_seconds(args.width, args.layers, args.batch, args.replicas,
                                      args.repeats)
    print(f"width {args.width} x {args.layers} layers, batch {args.batch}, "
          f"{args.replicas} replicas: {seconds * 1e3:.3f} ms a replica a step")


if __name__ == "__main__":
    main()
