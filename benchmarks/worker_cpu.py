"""Benchmark: the CPU seconds each worker spends per step, per strategy.

Wall-clock step times on machines of this class move by a third within seconds; the
CPU a step costs its workers says how much work a strategy adds around the
arithmetic they share (exchanges, copies, sums, polls), and moves less. Two
single-thread processes on two cores also slow each other (shared caches and memory
bandwidth), so PyTorch DDP's two ranks (gloo, benchmarks/ddp_peer.py), timed the
same way, are the yardstick for that part. The engines
of `single`, `kernel`, `data` and `hybrid` share one embedded cluster of two
single-thread workers and are kept warm (benchmarks/side_by_side.py's contenders);
each round gives each a burst of steps, and every worker's CPU time (user + system,
from /proc) is read before and after. A burst's CPU includes its restart and the
checkpoint written at its end, so the figures are per step of the burst, a little
above a long run's. Beside it, the wall time of the steps' compute phases (the
arithmetic, from the receipts; steps after a burst's first two), all workers
together: what is left of the CPU is work around the arithmetic.

    python -m benchmarks.worker_cpu --net small --batch 128 --rounds 6
"""

from __future__ import annotations

import argparse
import os
import tempfile
from statistics import median

from benchmarks.nets import NETS, net_path
from benchmarks.side_by_side import DDPContender, engine_contenders, run_configs
from pipeline.cluster.workers import find_workers
from pipeline.cluster.startup import Startup, start_cluster


STRATEGIES = ("single", "kernel", "data", "hybrid")
DDP = "ddp-gloo-2"


def process_cpu() -> float:
    """This process's CPU seconds (user + system), all its threads."""
    times = os.times()
    return times.user + times.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--net", choices=sorted(NETS), default="small")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--burst", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    per_step: dict[str, list[dict[str, float]]] = {name: [] for name in (*STRATEGIES, DDP)}
    computing: dict[str, list[float]] = {name: [] for name in STRATEGIES}
    with tempfile.TemporaryDirectory() as workdir:
        config = run_configs(args.net, args.batch, 2, workdir)
        shared = config("strategy=kernel")
        with start_cluster(shared, Startup("worker-cpu", False), print) as (client, _):
            offered = find_workers(client, shared.cluster)
            names = {w.address: w.name for w in offered}
            contenders = engine_contenders(STRATEGIES, config, client, offered)
            ddp = DDPContender(DDP, net_path(args.net),
                               [f"train.batch={args.batch}"])
            for round_ in range(args.rounds):
                ddp.burst(args.burst)
                per_step[DDP].append({f"rank {r}": cpu / args.burst
                                      for r, cpu in enumerate(ddp.cpu)})
                for contender in contenders:
                    before = client.run(process_cpu)
                    first = contender.position
                    contender.burst(args.burst)
                    after = client.run(process_cpu)
                    cells = contender.recorder.cells
                    computing[contender.name].append(median(
                        sum(cells[(step, w.name)]["compute_time"] for w in offered)
                        for step in range(first + 2, contender.position)))
                    per_step[contender.name].append(
                        {names[a]: (after[a] - before[a]) / args.burst for a in after})
            for contender in [ddp, *contenders]:
                contender.close()
    print(f"{args.net} network, batch {args.batch}: CPU seconds per step, median of "
          f"{args.rounds} bursts of {args.burst} steps")
    single = median(sum(r.values()) for r in per_step["single"])
    for name, rows in per_step.items():
        total = median(sum(r.values()) for r in rows)
        workers = ", ".join(f"{w} {median(r[w] for r in rows):.4f}" for w in rows[0])
        inside = (f"; compute phases {median(computing[name]):.4f} s"
                  if computing.get(name) else "")
        print(f"  {name:10s} all workers {total:.4f} s ({total / single:.3f}x single's): "
              f"{workers}{inside}")


if __name__ == "__main__":
    main()
