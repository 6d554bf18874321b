"""Benchmark: the exchange workspace across links over sftp and over S3, side by side.

    python -m benchmarks.link_transports                 # 1gbit and 100mbit, 3 repeats
    python -m benchmarks.link_transports --rates 1gbit 50mbit --repeats 5 --steps 12

`configs/small.yaml` (kernel, 2 single-thread CPU workers, batch 64), `placement=even`
so every run has the same split, each worker behind `cluster.link.rate`, the
workspace over `cluster.link.workspace` sftp (sshfs) or s3 (moto's S3 emulator in
server mode: its figures are the protocol's cost over the link, not a cloud
service's). Every repeat runs each (rate, transport) once, in one interleaved
sequence, so a change in the machine's load touches every cell alike. Per cell: the
median over repeats of each run's median step time (warm-up step excluded), the
runs' range, and the bytes per measured step the record counts (workspace + dataset)
against what the links carried per step over the whole run (start and checkpoints
included). Then the small-operation latency from a worker behind a link: a ready
marker written and read back (median of 50), as the workspace's polling sees it.
Needs root, sshd, sshfs, and the extra `s3` (s3fs, moto). Prints figures; not a test.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
from statistics import median

from pipeline.cluster.linked import open_linked_cluster
from pipeline.config.run_config import load_run_config
from pipeline.engine.step_engine import workspace_path
from pipeline.engine.dataset import prepare_dataset
from pipeline.run import run_training
from storage.exchange import Markers, create_exchange
from storage.exchange_folders import remove_exchange

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRANSPORTS = ("sftp", "s3")


def config_for(workdir: str, rate: str, transport: str, steps: int, name: str):
    return load_run_config(os.path.join(ROOT, "configs/small.yaml"), [
        f"cluster.link.rate={rate}", f"cluster.link.workspace={transport}",
        "placement=even", f"train.steps={steps}", "train.checkpoint_every=0",
        "train.eval_samples=0", "progress=false", f"data.path={workdir}/small.zarr",
        f"output={workdir}/{name}"])


def one_run(workdir: str, rate: str, transport: str, steps: int, repeat: int) -> dict:
    result = run_training(config_for(workdir, rate, transport, steps,
                                     f"{rate}-{transport}-{repeat}"))
    record, summary = result.record, result.summary
    tail = record.isel(step=slice(1, None))
    counted = float((tail.workspace_bytes + tail.dataset_bytes).sum("worker").median())
    crossed = sum(summary["link_bytes_received"].values()) + sum(
        summary["link_bytes_sent"].values())
    return {"step": summary["step_time_median"], "counted": counted,
            "crossed": crossed / record.sizes["step"]}


def marker_latency(workdir: str, transport: str, rate: str) -> float:
    """Median seconds of one marker write + read by a worker behind a link."""
    config = config_for(workdir, rate, transport, 1, "latency")
    with open_linked_cluster(config.cluster, config.shared_directories()) as (client, _):
        path = workspace_path(config, f"latency-{transport}", [])
        create_exchange(path, [])

        def probe(path: str = path) -> float:
            markers, times, slot = Markers(path), [], f"probe-{os.getpid()}"
            for step in range(51):
                started = time.perf_counter()
                markers.set(slot, step)
                assert markers.get(slot) == step
                times.append(time.perf_counter() - started)
            return median(times[1:])

        try:
            return median(client.run(probe).values())
        finally:
            remove_exchange(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "100mbit"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.ERROR)  # closing comms' INFO lines
    workdir = tempfile.mkdtemp(prefix="link-transports-", dir="/tmp")
    try:
        measure(workdir, args)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def measure(workdir: str, args: argparse.Namespace) -> None:
    prepare_dataset(config_for(workdir, args.rates[0], "sftp", 1, "data"))
    runs: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(args.repeats):
        for rate in args.rates:
            for transport in TRANSPORTS:
                found = one_run(workdir, rate, transport, args.steps, repeat)
                runs.setdefault((rate, transport), []).append(found)
                print(f"repeat {repeat}: {rate} {transport}: step {found['step']:.3f} s",
                      flush=True)
    print("\n| links | workspace | step time, median of runs (range) | to sftp's, per "
          "repeat: median (range) | counted MB/step | links MB/step (whole run) |\n"
          "|---|---|---|---|---|---|")
    for rate in args.rates:
        for transport in TRANSPORTS:
            cell = runs[(rate, transport)]
            steps = [r["step"] for r in cell]
            ratios = [r["step"] / s["step"] for r, s in zip(cell, runs[(rate, "sftp")])]
            print(f"| {rate} | {transport} | {median(steps):.3f} s ({min(steps):.3f}-"
                  f"{max(steps):.3f}) | {median(ratios):.2f} ({min(ratios):.2f}-"
                  f"{max(ratios):.2f}) | "
                  f"{median(r['counted'] for r in cell) / 1e6:.2f} | "
                  f"{median(r['crossed'] for r in cell) / 1e6:.2f} |")
    for transport in TRANSPORTS:
        seconds = marker_latency(workdir, transport, args.rates[0])
        print(f"marker write + read from a worker behind {args.rates[0]}, {transport}: "
              f"{seconds * 1e3:.2f} ms (median of 50)")


if __name__ == "__main__":
    main()
