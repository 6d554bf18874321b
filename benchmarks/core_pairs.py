"""Whether this machine's cores run two workers' compute as fast as one: the same
single-thread convolution loop timed alone, then in two processes at once, in turn.

On a machine whose cores are its own the pair takes as long as one alone (ratio
1.0). A virtual machine's cores may share a physical core's units with each other or
with other guests at some moments and not at others: then the pair's time flips
between 1.0x and up to 1.5x, second by second, and every 2-worker step does too.
A probe taken in one state predicts the other state's runs that far off, which no
model of the step can foresee (docs/model.md, Limitations, "The probe's moment").
This benchmark says how often and how far that happens on the machine at hand.

    python -m benchmarks.core_pairs --trials 20
"""

from __future__ import annotations

import argparse
import multiprocessing
import time

import numpy as np
import torch

#: A ratio at or above this counts as a trial where the cores shared their work (the
#: pairs of a machine with cores of its own read 0.95-1.05).
SHARED = 1.15


def _shapes():
    """The loop's operands: the small network's second layer at batch 16 (one thread)."""
    torch.set_num_threads(1)
    return torch.randn(16, 32, 16, 16), torch.randn(64, 32, 5, 5)


def conv_loop(rounds: int, result: multiprocessing.Queue) -> None:
    """`rounds` single-thread convolutions; puts their wall seconds."""
    images, weight = _shapes()
    start = time.perf_counter()
    for _ in range(rounds):
        torch.nn.functional.conv2d(images, weight, padding=2)
    result.put(time.perf_counter() - start)


def rounds_for(seconds: float) -> int:
    """How many rounds of the loop take about `seconds` alone (timed here)."""
    images, weight = _shapes()
    torch.nn.functional.conv2d(images, weight, padding=2)  # past the first call's set-up
    start = time.perf_counter()
    for _ in range(4):
        torch.nn.functional.conv2d(images, weight, padding=2)
    return max(int(seconds / ((time.perf_counter() - start) / 4)), 1)


def timed(processes: int, rounds: int) -> float:
    """The longest wall time of `processes` loops of `rounds` started together."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    workers = [context.Process(target=conv_loop, args=(rounds, results))
               for _ in range(processes)]
    for worker in workers:
        worker.start()
    times = [results.get() for _ in workers]
    for worker in workers:
        worker.join()
    return max(times)


def summary(alone: list[float], pair: list[float]) -> str:
    """Each side's median and range (the machine's own speed moves the loop alone
    too), and the ratios pair by pair: median, quartiles, range, and how many trials
    shared the cores."""
    ratios = [p / a for a, p in zip(alone, pair)]
    low, median, high = np.percentile(ratios, [25, 50, 75])
    shared = sum(r >= SHARED for r in ratios)
    return (f"alone: median {np.median(alone) * 1e3:.1f} ms (range "
            f"{min(alone) * 1e3:.1f}-{max(alone) * 1e3:.1f}); pair: median "
            f"{np.median(pair) * 1e3:.1f} ms (range {min(pair) * 1e3:.1f}-"
            f"{max(pair) * 1e3:.1f})\n"
            f"pair / alone over {len(ratios)} trials: median {median:.2f} (quartiles "
            f"{low:.2f}-{high:.2f}, range {min(ratios):.2f}-{max(ratios):.2f}); "
            f"{shared} of {len(ratios)} at {SHARED} or more")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=0.2,
                        help="each loop's length alone")
    parser.add_argument("--pause", type=float, default=1.0,
                        help="seconds between trials, so that they sample moments apart")
    args = parser.parse_args()
    from pipeline.probe.machine import machine_identity
    print(machine_identity())
    rounds = rounds_for(args.seconds)
    alone, pair = [], []
    for _ in range(args.trials):
        alone.append(timed(1, rounds))
        pair.append(timed(2, rounds))
        print(f"{time.strftime('%H:%M:%S')} alone {alone[-1] * 1e3:6.1f} ms  pair "
              f"{pair[-1] * 1e3:6.1f} ms  ratio {pair[-1] / alone[-1]:.2f}", flush=True)
        time.sleep(args.pause)
    print(summary(alone, pair))


if __name__ == "__main__":
    main()
