"""Predict finished runs again from their own cached probes, with and without the
timeline's uneven-step waits (`DeviceSpec.spread`, costmodel/timeline.py).

    python -m benchmarks.repredict RUN_DIR [RUN_DIR ...]

Each run directory (a `python -m pipeline.train` output or a sweep point's: its
config.yaml and summary.json) names the probe its prediction came from
(``prediction_probe``); that probe, from the cache, predicts the run again at the
split and steps per task it ran, once as the model now does and once with every
device's spread set to 0 (the model before the term). Prints per run: measured step,
both predictions and their errors, and the compute error (the probe's compute
against the run's: what drift of the machine between probe and run explains). Not
a test: a figure for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from pipeline.config.run_config import load_run_config
from pipeline.prediction import predict_config
from pipeline.probe import ClusterProbe, find_cached_probe


class Steady(ClusterProbe):
    """A probe whose devices keep no spread: the model without uneven-step waits."""

    def device_specs(self, active=None):
        return [dataclasses.replace(d, spread=0.0) for d in super().device_specs(active)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (config.yaml, summary.json)")
    args = parser.parse_args()
    print("run | measured s | predicted s (error) | without spread (error) | compute error "
          "| spreads")
    for run in args.runs:
        config = load_run_config(os.path.join(run, "config.yaml"))
        with open(os.path.join(run, "summary.json"), encoding="utf-8") as handle:
            summary = json.load(handle)
        probe = find_cached_probe(summary.get("prediction_probe") or "", any_age=True)
        if probe is None:
            print(f"{run}: its probe ({summary.get('prediction_probe')}) is not cached")
            continue
        measured = summary["step_time_median"]
        splits = {"kernel_split": summary.get("kernel_split"),
                  "batch_split": summary.get("batch_split"),
                  "task_steps": round(summary.get("task_steps_median") or 1),
                  "split_workers": summary.get("split_workers")}
        steady = Steady(**{f.name: getattr(probe, f.name) for f in dataclasses.fields(probe)})
        now, before = (predict_config(config, p, **splits).step_time for p in (probe, steady))
        active = len(summary.get("workers") or probe.workers)
        spread = ", ".join(f"{d.spread:.2f}" for d in probe.device_specs(active))
        compute = summary.get("compute_error")
        print(f"{run} | {measured:.4f} | {now:.4f} ({now / measured - 1:+.1%}) | "
              f"{before:.4f} ({before / measured - 1:+.1%}) | "
              f"{'-' if compute is None else f'{compute:+.1%}'} | {spread}")


if __name__ == "__main__":
    main()
