"""The peer: PyTorch DistributedDataParallel (gloo on localhost), as users run it.

Not part of the product: a row in the benchmarks that every strategy of ours is held
to. The same network (configs/*.yaml), global batch, data store, sample indices
and SGD as `strategy: data`: one process per worker, one torch thread each, each
rank training on its share of the batch (the loss a mean over its share: DDP
averages the ranks' gradients, which with equal shares is the whole batch's
gradient). A step's time is rank 0's, dataset read included, as a run's is.

    python -m benchmarks.ddp_peer --net small --batch 128 --workers 2
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from statistics import median
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from benchmarks.nets import NETS, net_path
from pipeline.config.run_config import load_run_config
from pipeline.engine.sampler import step_indices
from pipeline.engine.dataset import prepare_dataset
from tasks.network import build_network, initial_state, set_dropout, to_torch
from tasks.optim import make_sgd
from tasks.replica_layout import ranges, split_counts
from tasks.worker_state import configure_process
from storage.datasets import read_batch




def ddp_steps(rank: int, world: int, rendezvous: str, config_path: str, overrides: list[str],
              exchange: bool = True) -> Callable[[int], float]:
    """Join the process group and build this rank's DDP replica; returns a function
    that trains one step (its number picks the batch) and gives its seconds.

    ``exchange=False``: the same replica without DDP, and a barrier in place of the
    gradients' allreduce (the ranks still wait for each other every step). Its
    replicas drift apart, so it is no training run: it times the arithmetic alone,
    on the same cores at once, which no data-parallel scheme doing that arithmetic
    can beat (the floor under `data`/DDP's ratio)."""
    configure_process(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the ranks' connections on loopback only
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)
    config = load_run_config(config_path, overrides)
    info = prepare_dataset(config) if rank == 0 else None
    dist.barrier()
    info = info or prepare_dataset(config)
    network = config.network_spec(info.image_shape)
    model = build_network(network)
    model.load_state_dict(to_torch(initial_state(network, config.train.seed)))
    ddp = DistributedDataParallel(model) if exchange else model
    optimizer = make_sgd(ddp.parameters(), config.optimizer_spec())
    batch = config.train.batch
    start, stop = ranges(split_counts(batch, world))[rank]

    def step(number: int) -> float:
        indices = step_indices(config.train.seed, number, batch, info.train_samples)
        t0 = time.perf_counter()
        images, labels = read_batch(info.path, "train", indices[start:stop])
        optimizer.zero_grad(set_to_none=True)
        set_dropout(model, config.train.seed, number, slice(start, stop), batch)
        F.cross_entropy(ddp(torch.from_numpy(images)), torch.from_numpy(labels)).backward()
        optimizer.step(number)
        if not exchange:
            dist.barrier()
        return time.perf_counter() - t0
    return step


def _rank(rank: int, world: int, rendezvous: str, config_path: str, overrides: list[str],
          steps: int, queue: mp.Queue) -> None:
    step = ddp_steps(rank, world, rendezvous, config_path, overrides)
    queue.put((rank, [step(number) for number in range(steps)]))
    dist.destroy_process_group()


def rendezvous_file(folder: str) -> str:
    """Where the ranks meet: a file (torch's FileStore) in `folder`, which must exist
    as long as they run. Not a TCP rendezvous: torch's TCPStore listens on every
    interface, and nothing the project starts listens beyond loopback."""
    return os.path.join(folder, "ddp-rendezvous")


def measure_ddp(net: str, batch: int, steps: int, workers: int = 2, warmup: int = 1) -> float:
    """Median step time of DDP over `workers` processes (warm-up steps excluded)."""
    overrides = [f"train.batch={batch}", "progress=false"]
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        # daemons: if this process fails, its exit ends the ranks too
        processes = [context.Process(target=_rank, daemon=True, args=(
            r, workers, rendezvous_file(folder), net_path(net), overrides,
            steps, queue)) for r in range(workers)]
        for process in processes:
            process.start()
        results = dict(queue.get(timeout=3600) for _ in processes)
        for process in processes:
            process.join()
    return median(results[0][warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--net", choices=sorted(NETS), default="small")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    seconds = measure_ddp(args.net, args.batch, args.steps, args.workers)
    print(f"DDP-gloo, {args.workers} processes, {args.net} network, batch {args.batch}: "
          f"median step {seconds:.4f} s")


if __name__ == "__main__":
    main()
