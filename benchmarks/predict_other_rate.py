"""Predict measured link runs from a probe of the same cluster at another rate.

    python -m benchmarks.predict_other_rate PROBE_KEY RUN_DIR [RUN_DIR ...]

Probing a cluster behind a slow link costs what its calibration runs move over it:
the paper network's replica plan moves 76 MB of conv gradients per worker and
step, so its probe behind 20mbit would take most of an hour here. This predicts
each run (a sweep point's directory: config.yaml, summary.json) from the cached
cluster probe PROBE_KEY (compute, Dask constants, dataset read as probed) with the
workspace's per-access bandwidths scaled by the ratio of the run's link rate to
the probe's, the per-access latencies kept. An **extrapolation**, which the
model proper never makes (docs/model.md, "Links"): say so wherever its figures go.
Prints measured, predicted and the error per run; not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from pipeline.config import load_run_config
from pipeline.links import rate_bits
from pipeline.prediction import predict_config
from pipeline.probe import find_cached_probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("probe", help="cached cluster probe key (summary.json's prediction_probe)")
    parser.add_argument("probe_rate", help="the link rate the probe was taken at, e.g. 100mbit")
    parser.add_argument("runs", nargs="+", help="run directories (config.yaml, summary.json)")
    args = parser.parse_args()
    probe = find_cached_probe(args.probe)
    if probe is None:
        sys.exit(f"no cached probe {args.probe} of this probe version")
    for run in args.runs:
        config = load_run_config(os.path.join(run, "config.yaml"))
        with open(os.path.join(run, "summary.json"), encoding="utf-8") as f:
            summary = json.load(f)
        scale = rate_bits(str(config.cluster.link.rate)) / rate_bits(args.probe_rate)
        store = dataclasses.replace(probe.store, read_bw=probe.store.read_bw * scale,
                                    write_bw=probe.store.write_bw * scale)
        prediction = predict_config(config, dataclasses.replace(probe, store=store),
                                    kernel_split=summary.get("kernel_split"),
                                    batch_split=summary.get("batch_split"))
        predicted, parts = prediction.step_time, prediction.breakdown
        measured, critical = summary["step_time_median"], summary.get("critical_breakdown", {})
        print(f"{os.path.basename(run.rstrip('/'))}: measured {measured:.3f} s, predicted "
              f"{predicted:.3f} s ({predicted / measured - 1:+.0%}); compute "
              f"{critical.get('compute', float('nan')):.2f} s measured, "
              f"{parts['compute_critical'] + parts['master']:.2f} s predicted; workspace "
              f"{critical.get('exchange', float('nan')) + critical.get('dataset', 0.0):.2f} s, "
              f"{parts['storage']:.2f} s (the critical worker's)")


if __name__ == "__main__":
    main()
