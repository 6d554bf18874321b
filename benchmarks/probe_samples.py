"""What a sweep's probe samples buy: its runs predicted again from one sample, from the
samples before each run (what the runs recorded), and from every sample of the sweep.

    CNN_PROBE_CACHE=DIR python -m benchmarks.probe_samples RUNS_DIR

``RUNS_DIR`` is a measured sweep's ``<name>.runs`` folder (`probe_samples:
per_repeat`, 2 to 5 repeats: the cache keeps the newest `MAX_SAMPLES` = 5 samples, so
a longer sweep's first ones are gone), ``DIR`` the probe cache it ran with. For every
run predicted from a cluster probe, the probe's samples (pipeline/probe/samples.py)
predict it again at the split and steps per task it ran:

- ``first``: from the first sample alone, what `probe_samples: once` predicts;
- ``latest``: from the newest sample before the run alone (the probe nearest the run
  in time: where even it misses with one sign, the probe and the runs differ);
- ``so far``: from the median of the samples taken before the run, what it recorded
  (a check: it must equal the recorded prediction);
- ``all``: from the median of every sample the sweep took, which a run could only have
  in hindsight;
- ``each``: the smallest and largest error over single samples, what one probe taken
  at another moment would have given.

Prints a line per run, then per strategy and worker count the median of each error.
`reference` runs (predicted from a probe of this process, not of a cluster) are left
out. Not a test: figures for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import defaultdict
from statistics import median

from pipeline.config.run_config import load_run_config
from pipeline.prediction import predict_point
from pipeline.probe import ClusterProbe, cached_samples
from pipeline.probe.samples import merge_samples


def errors(run: str) -> dict[str, float] | None:
    """The run's errors from its probe's samples, as the module doc lists (None for a
    run without a cluster probe's prediction, or whose samples are not cached)."""
    config = load_run_config(os.path.join(run, "config.yaml"))
    with open(os.path.join(run, "summary.json"), encoding="utf-8") as handle:
        summary = json.load(handle)
    key, taken = summary.get("prediction_probe"), summary.get("prediction_probe_samples")
    samples = cached_samples(key) if key and taken else []
    if not samples or taken > len(samples):
        return None

    def error(probe: ClusterProbe) -> float:
        return predict_point(config, summary, probe, policy="cached")["prediction_error"]

    each = [error(sample) for sample in samples]
    return {"first": each[0], "latest": each[taken - 1],
            "so far": error(merge_samples(samples[:taken])),
            "all": error(merge_samples(samples)), "each low": min(each),
            "each high": max(each), "recorded": summary["predicted_step_time"]
            / summary["step_time_median"] - 1, "samples": taken}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", help="a sweep's <name>.runs folder")
    args = parser.parse_args()
    groups: dict[str, list[dict[str, float]]] = defaultdict(list)
    print("run | samples | recorded | first | latest | so far | all | each (low..high)")
    for name in sorted(os.listdir(args.runs)):
        found = errors(os.path.join(args.runs, name))
        if found is None:
            continue
        strategy = re.search(r"strategy=([a-z]+)", name)
        workers = re.search(r"workers=(\d+)", name)
        group = f"{strategy.group(1) if strategy else '?'}/{workers.group(1) if workers else '?'}"
        groups[group].append(found)
        print(f"{name} | {found['samples']:.0f} | {found['recorded']:+.1%} | "
              f"{found['first']:+.1%} | {found['latest']:+.1%} | {found['so far']:+.1%} | "
              f"{found['all']:+.1%} | "
              f"{found['each low']:+.1%}..{found['each high']:+.1%}")
    print("\nmedian error per strategy/workers | runs | first (once) | latest | so far "
          "(per_repeat) | all | each low | each high")
    for group, found in sorted(groups.items(), key=lambda kv: kv[0].split("/")[::-1]):
        cells = " | ".join(f"{median(f[c] for f in found):+.1%}"
                           for c in ("first", "latest", "so far", "all", "each low",
                                     "each high"))
        print(f"{group} | {len(found)} | {cells}")


if __name__ == "__main__":
    main()
