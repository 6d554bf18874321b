"""What a sweep store's checksums cost: a point's write, and verifying the whole store.

Builds stores the size of the shipped sweeps (quick.yaml's 12 points, marques_cpu's
288) from their templates, writes every point with made-up figures of a measured
point (every variable set, a 10-step series), then times `ResultStore.write_point`
plus `refresh_derived` per point and the verification a resume or a report makes
(every file read, median of `--repeats`, page cache warm). Nothing trains.

    python -m benchmarks.sweep_store_checks --points 12 288 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import yaml

from experiments.sweep.results import PointResult, ResultStore
from experiments.sweep.store_layout import DERIVED, MEASURES, TEXTS, build_template
from experiments.sweep.config import load_sweep


def sweep_of(points: int, folder: str):
    """A sweep of about `points` points (3 strategies x 2 batches x lr, 2 repeats)."""
    lrs = [0.01 * (i + 1) for i in range(max(1, points // 12))]
    config = {"name": "bench", "base": {"strategy": "kernel", "data": {"path": "x.zarr"}},
              "measure": {"warmup_steps": 1, "steps": 10},
              "axes": {"strategy": ["single", "kernel", "data"], "train.batch": [8, 16],
                       "train.lr": lrs}, "repeats": 2}
    path = os.path.join(folder, "bench.yaml")
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(config, handle)
    return load_sweep(path, out=os.path.join(folder, "bench.zarr"))


def measure(points: int, repeats: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        sweep = sweep_of(points, folder)
        store = ResultStore(sweep.store_path)
        store.create(build_template(sweep, {"fingerprint": sweep.fingerprint}))
        result = PointResult({name: 1.5 for name in MEASURES if name not in DERIVED},
                             {name: "[1, 2]" for name in TEXTS if name != "failure"},
                             {"step_time_series": np.linspace(0.1, 0.2, 11),
                              "loss_series": np.linspace(2.3, 2.0, 11)})
        writes = []
        for point in sweep.points:
            started = time.perf_counter()
            store.write_point(point.region, result)
            store.refresh_derived()
            writes.append(time.perf_counter() - started)
        checks = []
        for _ in range(repeats):
            started = time.perf_counter()
            assert ResultStore(sweep.store_path).record.verify().intact
            checks.append(time.perf_counter() - started)
        files = sum(len(names) for _d, _s, names in os.walk(sweep.store_path))
        return {"points": len(sweep.points), "files": files,
                "write_s": statistics.median(writes), "verify_s": statistics.median(checks),
                "verify_best_s": min(checks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, nargs="+", default=[12, 288])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for points in args.points:
        row = measure(points, args.repeats)
        print(f"{row['points']} points, {row['files']} files: write+refresh "
              f"{row['write_s'] * 1e3:.0f} ms a point (median); verify "
              f"{row['verify_s'] * 1e3:.0f} ms (median of {args.repeats}, best "
              f"{row['verify_best_s'] * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
