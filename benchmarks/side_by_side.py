"""Benchmark: every contender kept warm, a burst of steps each in turn, many rounds.

`engine_speedup.py strategies` starts a fresh run (its cluster, its DDP processes)
for every contender in every repeat: a repeat of seven runs takes most of a minute,
and on machines of this class, whose speed moves by a third within minutes, the
per-repeat ratios spread wider than the targets' margins. Here every contender is
started once and stays warm: `reference` on 1 and 2 threads in this process, DDP's
two ranks waiting on a pipe (and the same two ranks without the allreduce, a
barrier in its place: the arithmetic alone, the floor under `data`), and `single`,
`kernel`, `data` and `hybrid` as engines sharing one embedded cluster of two
single-thread workers (each run keeps its own state and workspace on them). A
round gives each contender a burst of steps, in the listed order in even rounds and
reversed in odd ones, so a round lasts seconds and the ratios of one round compare
runs that close together.

A burst is the training loop itself (pipeline/training/loop.py: tasks of ``auto`` steps, two
in flight, the same step times a run records) over the next ``--burst`` steps; its
first ``--skip`` steps (the restart after idling: a task of one step, then one
sized by it) are left out and the rest's median is the burst's figure. Each ratio
is the median over rounds of the per-round ratios, with their spread (min-max) and a
95 % interval for the median (`engine_speedup.median_interval`: the machine's
second-to-second noise still spreads single rounds wider than the margins, so a
verdict rests on the interval, which narrows as rounds are added), and the run ends
with a verdict per target (`engine_speedup.TARGETS`). With
``--one-worker`` every strategy runs on one worker against `reference` on one
thread (the target "on one worker every strategy <= 1.05x reference"). With
``--devices`` the engines' workers are those devices (`cluster.devices`, GPU workers
first) and the yardstick is plain PyTorch on the first CUDA device among them
(`torch-gpu`: the reference's loop there, cuDNN's autotuning on as on the workers);
there is no DDP or CPU reference then, and no target, only the ratios.

    python -m benchmarks.side_by_side --net small --batch 128 --rounds 15
    python -m benchmarks.side_by_side --net small --batch 64 --one-worker
    python -m benchmarks.side_by_side --net paper --batch 32 --burst 3 --skip 1 --rounds 9 \\
        --only ddp-gloo-2 kernel data hybrid
    python -m benchmarks.side_by_side --net paper --batch 32 --burst 3 --skip 1 --rounds 10 \\
        --only ddp-gloo-2 replicas-no-exchange-2 data
    python -m benchmarks.side_by_side --net resnet20 --batch 128 --devices cuda:0 cpu cpu \\
        --threads 4 --rounds 7 --burst 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
import weakref
from multiprocessing.connection import Connection
from statistics import median
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from distributed import Client
import torch.multiprocessing as mp

from benchmarks.nets import NETS, net_path
from benchmarks.ddp_peer import ddp_steps, rendezvous_file
from benchmarks.engine_speedup import TARGETS, ratio_report, run_order, target_lines
from pipeline.engine.checkpointing import prepare_checkpoints
from pipeline.strategies import strategy_named
from pipeline.cluster.workers import ClusterWorker, find_workers
from pipeline.config.cluster_config import DEVICE_NAME
from pipeline.config.run_config import RunConfig, load_run_config
from pipeline.engine.dataset import prepare_dataset
from pipeline.training.loop import Trainer, train_loop
from pipeline.preflight import check_run
from pipeline.records.record import RunRecorder
from pipeline.training.recovery import build_engine
from pipeline.training.reference import REFERENCE_WORKER, ReferenceTrainer
from pipeline.cluster.startup import Startup, start_cluster
from tasks.worker_state import configure_process


#: ``--one-worker``'s targets: every strategy on one worker within 5 % of the reference.
ONE_WORKER_TARGETS = [(f"{name} step time / reference 1 thread", "<=", 1.05)
                      for name in ("single", "kernel", "data", "hybrid")]


#: DDP's ranks without the allreduce: the arithmetic alone on the same cores at once.
NO_EXCHANGE = "replicas-no-exchange-2"

#: ``--devices``' yardstick: plain PyTorch on the first CUDA device.
TORCH_GPU = "torch-gpu"


class Contender(Protocol):
    """One thing being timed, kept warm between its bursts."""

    name: str

    def burst(self, steps: int) -> list[float]: ...  # the next `steps` steps' seconds
    def close(self) -> None: ...


def with_steps(config: RunConfig, steps: int) -> RunConfig:
    return dataclasses.replace(config, train=dataclasses.replace(config.train, steps=steps))


@dataclasses.dataclass
class LoopContender:
    """A trainer (an engine on the shared cluster, or the in-process reference)
    driven by the training loop, `steps` at a time, from where it stopped."""

    name: str
    config: RunConfig
    trainer: Trainer
    recorder: RunRecorder
    train_samples: int
    threads: int  # this process's torch threads while it runs (the client's: 1)
    position: int = 0

    def burst(self, steps: int) -> list[float]:
        configure_process(self.threads)
        stop = self.position + steps
        train_loop(with_steps(self.config, stop), self.trainer, self.recorder, [],
                   self.position, self.train_samples)
        times = [self.recorder.steps[s]["step_time"] for s in range(self.position, stop)]
        self.position = stop
        return times

    def close(self) -> None:
        self.trainer.close()


def run_configs(net: str, batch: int, workers: int | list[str], workdir: str,
                threads: int = 1) -> Callable[..., RunConfig]:
    """Makes the contenders' run configs: `net` at `batch` on `workers` workers (a
    count of CPU workers, or one worker per device, each CPU one of `threads` threads),
    no checkpoints but the one at a burst's end, no evaluation, each with an output
    folder of its own in `workdir`; its arguments are further ``key=value`` overrides."""
    cluster = ([f"cluster.workers={workers}"] if isinstance(workers, int) else
               [f"cluster.devices=[{', '.join(workers)}]", f"cluster.threads={threads}"])
    base = [f"train.batch={batch}", "progress=false", "train.checkpoint_every=0",
            "train.eval_samples=0", "train.steps=1", *cluster]

    def config(*overrides: str) -> RunConfig:
        return load_run_config(net_path(net), [
            *base, f"output={tempfile.mkdtemp(dir=workdir)}", *overrides])
    return config


def engine_contenders(names: Sequence[str], config: Callable[..., RunConfig], client: Client,
                      offered: list[ClusterWorker]) -> list[LoopContender]:
    """An engine of each strategy in `names` on `offered` (``single`` on the first)."""
    return [loop_contender(name, config(f"strategy={name}"), client,
                           offered[:1] if strategy_named(name).one_worker else offered)
            for name in names]


def loop_contender(name: str, config: RunConfig, client: Client | None = None,
                   offered: list[ClusterWorker] | None = None,
                   device: str = "cpu") -> LoopContender:
    """`config`'s trainer, loaded from its initial checkpoint: an engine of its
    strategy on `offered` of `client`'s workers, or the reference in this process (on
    `device`)."""
    strategy = check_run(config)
    info = prepare_dataset(config)
    network = config.network_spec(info.image_shape)
    start = prepare_checkpoints(config, network, print)
    if strategy.uses_cluster:
        configure_process(1)
        trainer = build_engine(client, config, strategy, network, info.train_samples, offered)
        workers = trainer.workers
        recorder = RunRecorder([w.name for w in workers], [w.label for w in workers],
                               [w.emulated_speed for w in workers])
        threads = 1
    else:
        if device.startswith("cuda"):  # as the engine's GPU workers (WorkerSetup)
            torch.cuda.set_device(torch.device(device))
            torch.backends.cudnn.benchmark = True
        trainer = ReferenceTrainer(config, network, info.train_samples, device)
        recorder = RunRecorder([REFERENCE_WORKER], ["in-process"], [1.0])
        threads = config.reference.threads
    trainer.start(start)
    return LoopContender(name, config, trainer, recorder, info.train_samples, threads, start)


def _serve_rank(rank: int, world: int, rendezvous: str, config_path: str,
                overrides: list[str], exchange: bool, commands: Connection) -> None:
    """A DDP rank that trains the steps it is told, in bursts, until told None; sends
    back each step's seconds and the burst's CPU seconds in this process."""
    step = ddp_steps(rank, world, rendezvous, config_path, overrides, exchange)
    done = 0
    while (count := commands.recv()) is not None:
        cpu = os.times()
        times = [step(number) for number in range(done, done + count)]
        after = os.times()
        commands.send((times, after.user + after.system - cpu.user - cpu.system))
        done += count
    dist.destroy_process_group()


class DDPContender:
    """PyTorch DDP over gloo, `world` processes kept running between bursts (each
    blocked on its pipe meanwhile); a step's time is rank 0's (benchmarks/ddp_peer.py).
    ``cpu``: each rank's CPU seconds in the last burst. ``exchange=False``: the same
    ranks without the gradients' allreduce (`ddp_steps`), the floor under `data`."""

    def __init__(self, name: str, config_path: str, overrides: list[str], world: int = 2,
                 exchange: bool = True):
        self.name = name
        self.cpu: list[float] = []
        self.folder = tempfile.mkdtemp(prefix="ddp-")  # the ranks' rendezvous file
        weakref.finalize(self, shutil.rmtree, self.folder, True)  # at exit, even on a failure
        context = mp.get_context("spawn")
        self.pipes, self.processes = [], []
        for rank in range(world):
            mine, theirs = context.Pipe()
            # daemons: if the benchmark fails, its exit ends the ranks too
            process = context.Process(target=_serve_rank, daemon=True, args=(
                rank, world, rendezvous_file(self.folder), config_path, overrides, exchange,
                theirs))
            process.start()
            self.pipes.append(mine)
            self.processes.append(process)

    def burst(self, steps: int) -> list[float]:
        for pipe in self.pipes:
            pipe.send(steps)
        replies = [pipe.recv() for pipe in self.pipes]
        self.cpu = [cpu for _times, cpu in replies]
        return replies[0][0]

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for process in self.processes:
            process.join(timeout=60)


def ratios(times: dict[str, list[float]], one_worker: bool) -> list[dict]:
    """The per-round ratios the targets name, as `ratio_report`s (those whose
    contenders ran)."""
    wanted = ([(f"{name} step time / reference 1 thread", name, "reference-1-thread")
               for name in ("single", "kernel", "data", "hybrid")] if one_worker else
              [("single step time / reference 1 thread", "single", "reference-1-thread"),
               ("kernel speedup over reference 1 thread", "reference-1-thread", "kernel"),
               ("kernel vs reference 2 threads", "reference-2-threads", "kernel"),
               *[(f"{name} step time / DDP-gloo's", name, "ddp-gloo-2")
                 for name in ("data", "hybrid", "kernel")],
               *[(f"{name} step time / replicas without exchange", name, NO_EXCHANGE)
                 for name in ("ddp-gloo-2", "data")],
               *[(f"{name} step time / torch on the GPU", name, TORCH_GPU)
                 for name in ("single", "kernel", "data", "hybrid")]])
    return [ratio_report(label, times[top], times[bottom]) for label, top, bottom in wanted
            if top in times and bottom in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--net", choices=sorted(NETS), default="small")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--burst", type=int, default=12, help="steps per burst")
    parser.add_argument("--skip", type=int, default=2, help="first steps of a burst left out")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--one-worker", action="store_true",
                        help="every strategy on one worker against the reference")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="time only these contenders (default: all)")
    parser.add_argument("--devices", nargs="+", metavar="DEVICE",
                        help="the engines' workers, one per device (cpu, cuda:N; GPU "
                        "workers first), against plain PyTorch on the first CUDA one")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of each CPU worker --devices makes")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if not 0 <= args.skip < args.burst:
        parser.error("--skip must be at least 0 and less than --burst")
    if args.devices:
        gpu = check_devices(parser, args)
        names = [TORCH_GPU, "single", "kernel", "data", "hybrid"]
    else:
        names = ["reference-1-thread", *([] if args.one_worker else
                                         ["reference-2-threads", "ddp-gloo-2", NO_EXCHANGE]),
                 "single", "kernel", "data", "hybrid"]
    unknown = set(args.only or []) - set(names)
    if unknown:
        parser.error(f"--only: no contender {', '.join(sorted(unknown))} (there are "
                     f"{', '.join(names)})")
    names = [name for name in names if name in (args.only or names)]
    with tempfile.TemporaryDirectory() as workdir:
        config = run_configs(args.net, args.batch,
                             args.devices or (1 if args.one_worker else 2), workdir, args.threads)
        prepare_dataset(config())  # once, before the DDP contenders' ranks look for it
        contenders: list[Contender] = [
            loop_contender(name, config("strategy=reference", f"reference.threads={threads}"))
            for name, threads in (("reference-1-thread", 1), ("reference-2-threads", 2))
            if name in names]
        if TORCH_GPU in names:
            contenders.append(loop_contender(TORCH_GPU, config("strategy=reference"),
                                             device=gpu))
        contenders += [DDPContender(name, net_path(args.net),
                                    [f"train.batch={args.batch}"], exchange=exchange)
                       for name, exchange in (("ddp-gloo-2", True), (NO_EXCHANGE, False))
                       if name in names]
        shared = config("strategy=kernel")
        with start_cluster(shared, Startup("side-by-side", False), print) as (client, _):
            contenders += engine_contenders(
                [n for n in ("single", "kernel", "data", "hybrid") if n in names], config,
                client, find_workers(client, shared.cluster))
            times = rounds(contenders, args)
            for contender in contenders:
                contender.close()
    report(times, args)


def check_devices(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """``--devices``' first CUDA device (plain PyTorch's); a bad list is a usage error."""
    bad = [device for device in args.devices if not DEVICE_NAME.fullmatch(device)]
    if bad:
        parser.error(f"--devices: expected cpu or cuda:N, got {', '.join(bad)}")
    gpus = [device for device in args.devices if device.startswith("cuda")]
    if not gpus:
        parser.error("--devices: name a CUDA device (plain PyTorch runs on the first)")
    if args.one_worker:
        parser.error("--one-worker and --devices: choose one")
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    if not torch.cuda.is_available():
        parser.error("--devices: torch sees no CUDA device on this machine")
    return gpus[0] if ":" in gpus[0] else "cuda:0"


def rounds(contenders: list[Contender], args: argparse.Namespace) -> dict[str, list[float]]:
    """Each contender's burst median per round, the rounds in alternating order."""
    times: dict[str, list[float]] = {c.name: [] for c in contenders}
    by_name = {c.name: c for c in contenders}
    for round_ in range(args.rounds):
        for name in run_order(list(by_name), round_):
            times[name].append(median(by_name[name].burst(args.burst)[args.skip:]))
        print(f"round {round_}: " + ", ".join(f"{n} {t[-1]:.4f}" for n, t in times.items()),
              flush=True)
    return times


def workers_text(args: argparse.Namespace) -> str:
    """The engines' workers, as the report's heading names them."""
    if args.devices:
        return f"workers on {' '.join(args.devices)} ({args.threads} threads a CPU worker)"
    return "one worker" if args.one_worker else "2 workers"


def report(times: dict[str, list[float]], args: argparse.Namespace) -> None:
    kept = args.burst - args.skip
    print(f"\n{args.net} network, batch {args.batch}, {args.rounds} rounds of bursts of "
          f"{args.burst} steps ({kept} kept), {workers_text(args)}")
    for name, values in times.items():
        print(f"  {name:20s} median {median(values):.4f} s  (rounds {min(values):.4f}-"
              f"{max(values):.4f})")
    reports = ratios(times, args.one_worker)
    for r in reports:
        print(f"  {r['ratio']}: {r['median']:.3f} (spread {r['min']:.3f}-{r['max']:.3f}, "
              f"95 % interval of the median {r['low']:.3f}-{r['high']:.3f})")
    targets = (ONE_WORKER_TARGETS if args.one_worker else [] if args.devices else
               TARGETS[args.net])
    print("\n".join(target_lines(targets, reports)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"args": vars(args), "times": times, "ratios": reports}, handle, indent=2)


if __name__ == "__main__":
    main()
