"""Timeline pictures of one step of `single` and of `kernel`, drawn from their traces.

Trains the small network (batch 128) with each strategy on an embedded cluster and
draws two steps of each run's trace.json (python -m experiments.trace_plot):

    python -m benchmarks.trace_figures docs/figures
"""

from __future__ import annotations

import os
import sys
import tempfile

from experiments.trace_plot import draw
from pipeline.config import load_run_config
from pipeline.run import run_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUNS = {"single": ["strategy=single", "cluster.workers=1"],
        "kernel": ["strategy=kernel", "cluster.workers=2", "placement=even"]}


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "docs/figures"
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        for name, overrides in RUNS.items():
            config = load_run_config(os.path.join(ROOT, "configs", "small.yaml"), [
                "train.batch=128", "train.steps=10", "train.eval_samples=0",
                "train.checkpoint_every=0", "progress=false", f"output={workdir}/{name}",
                *overrides])
            summary = run_training(config).summary
            picture = os.path.join(out, f"trace_{name}.png")
            draw(os.path.join(workdir, name, "trace.json"), [6, 7], picture,
                 f"small network, batch 128, `{name}`: steps 6 and 7 "
                 f"(median step {summary['step_time_median'] * 1e3:.0f} ms)")
            print(picture)


if __name__ == "__main__":
    main()
