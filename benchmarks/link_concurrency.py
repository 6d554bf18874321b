"""Benchmark: do the transfers of workers behind their own links serialise?

    python -m benchmarks.link_concurrency                   # 3 workers behind 100mbit
    python -m benchmarks.link_concurrency --workers 3 --rate 100mbit --repeats 3

Each worker sits behind its own shaped link (`cluster.link`), with the run's
directories mounted over sftp from the one sshd on the client's side. Every worker
writes and then reads back files in the mounted workspace, first one worker at a
time, then all at once, in three sizes: one large file (the links' rate), a step's
worth of hybrid-sized slots (344 KB each) and tiny files (the per-file cost). If
the workers' transfers serialised somewhere they share (the bridge, the sshd, the
machine's cores running sshd, sshfs and ssh's encryption), the concurrent seconds
would be about the worker count times the lone ones; if every link is independent,
the same. Prints per-worker medians; not a test. Needs root, sshd, sshfs.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
from statistics import median

from pipeline.cluster import open_linked_cluster
from pipeline.config import load_run_config
from storage.exchange import Markers, create_exchange

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: (label, file size in bytes, files): what each worker writes and then reads back
PATTERNS = (("one 4 MB file", 4_000_000, 1), ("8 slots of 344 KB", 344_064, 8),
            ("20 files of 1 KB", 1024, 20))


def transfer(directory: str, size: int, files: int, tag: str) -> tuple[float, float]:
    """Seconds to write `files` files of `size` bytes into `directory`, then to read
    them back (runs on a worker, through its mount)."""
    payload = os.urandom(size)
    names = [os.path.join(directory, f"{tag}-{os.getpid()}-{i}") for i in range(files)]
    started = time.perf_counter()
    for name in names:
        with open(name, "wb") as f:
            f.write(payload)
    written = time.perf_counter()
    for name in names:
        with open(name, "rb") as f:
            assert len(f.read()) == size
    read = time.perf_counter()
    for name in names:
        os.remove(name)
    return written - started, read - written


def poll(workspace: str, seconds: float) -> int:
    """Poll a ready marker that never comes for `seconds`, as a waiting reader does
    (storage.exchange.Exchange.wait's loop); the number of polls."""
    markers, pause, polls = Markers(workspace), 0.0001, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        markers.get("never")
        polls += 1
        time.sleep(pause)
        pause = min(pause * 2, 0.0005)
    return polls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.ERROR)
    workdir = tempfile.mkdtemp(prefix="link-concurrency-", dir="/tmp")
    try:
        config = load_run_config(os.path.join(ROOT, "configs/small.yaml"), [
            f"cluster.link.rate={args.rate}", f"cluster.workers={args.workers}",
            f"data.path={workdir}/small.zarr", f"output={workdir}/out",
            f"workspace.path={workdir}/ws"])
        directories = config.shared_directories()
        with open_linked_cluster(config.cluster, directories) as (client, _):
            space = os.path.join(directories[0], "concurrency")
            os.makedirs(space, exist_ok=True)
            workers = sorted(client.scheduler_info()["workers"])
            print(f"{args.workers} workers behind {args.rate}; seconds per worker "
                  "(median over workers and repeats): write, read")
            for label, size, files in PATTERNS:
                alone: list[tuple[float, float]] = []
                together: list[tuple[float, float]] = []
                for repeat in range(args.repeats):
                    for i, worker in enumerate(workers):
                        found = client.run(transfer, space, size, files, f"a{repeat}-{i}",
                                           workers=[worker])
                        alone.extend(found.values())
                    found = client.run(transfer, space, size, files, f"t{repeat}")
                    together.extend(found.values())
                bits = size * files * 8
                for name, rows in (("alone", alone), ("all at once", together)):
                    w, r = median(x[0] for x in rows), median(x[1] for x in rows)
                    print(f"  {label:18s} {name:11s} write {w:.3f} s ({bits / w / 1e6:6.1f}"
                          f" Mbit/s)  read {r:.3f} s ({bits / r / 1e6:6.1f} Mbit/s)", flush=True)
            polling(client, workers, directories[0], space, args.repeats)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def polling(client, workers: list[str], root: str, space: str, repeats: int) -> None:
    """The first worker's slots while the others idle, then while they poll."""
    workspace = os.path.join(root, "polling")
    create_exchange(workspace, [])
    label, size, files = PATTERNS[1]
    for others in ("idle", "polling"):
        rows = []
        for repeat in range(repeats):
            pollers = [client.submit(poll, workspace, 3.0, workers=[w], pure=False,
                                     key=f"poll-{others}-{repeat}-{w}")
                       for w in workers[1:]] if others == "polling" else []
            time.sleep(0.5)
            rows.extend(client.run(transfer, space, size, files, f"p{repeat}",
                                   workers=[workers[0]]).values())
            polls = client.gather(pollers)
        w, r = median(x[0] for x in rows), median(x[1] for x in rows)
        rate = f", {median(polls) / 3.0:.0f} polls/s each" if others == "polling" else ""
        print(f"  {label} on one worker, the others {others}: write {w:.3f} s, read "
              f"{r:.3f} s{rate}", flush=True)


if __name__ == "__main__":
    main()
