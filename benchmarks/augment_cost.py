"""What `data.augment: crop_flip` costs a step, against the step's compute: the crop
and flip of a batch (tasks/augment.py, as a worker applies it to the rows it read),
and a training step of ResNet-20 (forward, backward, SGD) in plain PyTorch on the same
batch, both on one thread. Medians of `--repeats`, each its own step number (its
own draws), after one warm-up.

    python -m benchmarks.augment_cost                        # resnet20, batch 128, float32
    python -m benchmarks.augment_cost --dtype float64 --width 0.5
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.config.run_config import load_run_config
from tasks.augment import crop_flip
from tasks.network import initial_state, load_model


def augment_seconds(images: np.ndarray, padding: int, repeats: int) -> float:
    """Median seconds of one batch's crop and flip."""
    indices = np.arange(len(images))
    crop_flip(images, indices, 0, 0, padding)  # warm-up
    times = []
    for step in range(1, repeats + 1):
        start = time.perf_counter()
        crop_flip(images, indices, 0, step, padding)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def step_seconds(images: np.ndarray, width: float, repeats: int) -> float:
    """Median seconds of one ResNet-20 training step on `images`."""
    config = load_run_config("configs/resnet20.yaml", [f"network.width={width}",
                                                       f"network.dtype={images.dtype}"])
    network = config.network_spec(images.shape[1:])
    model = load_model(network, initial_state(network, 0)).train()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    x = torch.from_numpy(images)
    y = torch.from_numpy(np.arange(len(images)) % network.classes)
    times = []
    for _ in range(repeats + 1):  # the first is the warm-up
        start = time.perf_counter()
        sgd.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        sgd.step()
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--size", type=int, default=32, help="the images' side")
    parser.add_argument("--padding", type=int, default=4)
    parser.add_argument("--width", type=float, default=1.0, help="resnet20's network.width")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    images = np.random.default_rng(0).standard_normal(
        (args.batch, 3, args.size, args.size)).astype(args.dtype)
    augment = augment_seconds(images, args.padding, 5 * args.repeats)
    step = step_seconds(images, args.width, args.repeats)
    print(f"batch {args.batch} of 3x{args.size}x{args.size} {args.dtype}, padding "
          f"{args.padding}: crop_flip {augment * 1e3:.2f} ms; resnet20 (width {args.width:g}) "
          f"step {step * 1e3:.0f} ms; {augment / step:.2%} of the step")


if __name__ == "__main__":
    main()
