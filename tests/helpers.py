"""Helpers for tests: configs for tiny runs and a plain PyTorch re-run of a training."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import subprocess
import time
from contextlib import contextmanager
from typing import Iterator

import dask
import numpy as np
import psutil
import torch
from distributed import Client
from torch import nn

from experiments.sweep import cli as sweep_cli
from pipeline import train as train_cli
from pipeline.cluster.embedded import QUIET, start_embedded_cluster
from pipeline.cluster.worker_setup import register_setup
from pipeline.config.cluster_config import ClusterConfig, WorkerConfig
from pipeline.config.run_config import RunConfig, build_run_config
from pipeline.cluster.security import write_credentials
from storage import checkpoints
from storage.datasets import open_dataset_info, read_batch
from tasks.network import load_model, set_dropout, to_arrays
from tests.augment_replay import augmented_batch
from tests.replica_replay import plain_scheduler, replay_network, step_schedulers
from tests.zoo_replay import load_torchvision


def wait_exited(processes: list[psutil.Process | int], timeout: float
                ) -> list[psutil.Process | int]:
    """Those of `processes` (or pids) still running after up to `timeout` seconds. A
    zombie has exited: an orphan (a child of a process that ended first) stays one
    until the machine's init reaps it, which here takes up to a second or two
    (psutil's `wait_procs` waited that out)."""
    def running(process: psutil.Process | int) -> bool:
        try:
            if isinstance(process, int):
                process = psutil.Process(process)
            return process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout
    while True:
        left = [process for process in processes if running(process)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


@contextmanager
def embedded_client(workers: list[WorkerConfig]) -> Iterator[tuple[Client, ClusterConfig]]:
    """A real scheduler and one process per worker (loopback), set up as a run sets
    its workers up; closed on exit. Yields the client and the cluster config."""
    config = ClusterConfig(workers=workers)
    cluster = start_embedded_cluster(config.worker_list())
    client = Client(cluster, set_as_default=False)
    try:
        register_setup(client, config)
        yield client, config
    finally:
        client.close()
        cluster.close()


@contextmanager
def worker_beside(shared: tuple[Client, ClusterConfig], worker: WorkerConfig
                  ) -> Iterator[tuple[Client, ClusterConfig]]:
    """`worker` started beside the workers of `shared` (an `embedded_client`'s cluster),
    as they were started (a nanny with their options and `QUIET`, its process forked
    from the same server), and set up as a run sets up its workers; yields the client
    and the config of all of them. Stopped after, and the others set up as before. For
    a worker only a module needs (tests/test_cluster.py's GPU-tagged one): an idle
    worker kept for the session costs its cluster about 9 ms of CPU a second."""
    client, config = shared
    cluster = client.cluster
    template = next(iter(cluster.worker_spec.values()))
    cluster.worker_spec[worker.name] = {
        "cls": template["cls"],
        "options": {**template["options"], "resources": dict(worker.resources)}}
    with_it = ClusterConfig(workers=[*config.workers, worker])
    try:
        with dask.config.set(QUIET):
            cluster.sync(cluster._correct_state)
        client.wait_for_workers(len(with_it.workers), timeout=120)
        register_setup(client, with_it)
        yield client, with_it
    finally:
        cluster.worker_spec.pop(worker.name, None)
        cluster.sync(cluster._correct_state)
        register_setup(client, config)


def scheduler_args(client: Client, folder: str) -> list[str]:
    """The command-line arguments that take a run to `client`'s cluster as an external
    one: `--scheduler` and, its embedded cluster speaking TLS with credentials made for
    it (pipeline/cluster/security.py), those credentials as files in `folder` (cluster.tls)."""
    tls = write_credentials(client.security, folder)
    return ["--scheduler", client.scheduler.address, f"cluster.tls.ca_file={tls.ca_file}",
            f"cluster.tls.cert={tls.cert}", f"cluster.tls.key={tls.key}"]


def shared_workers(shared: tuple[Client, ClusterConfig], tag: str,
                   changes: dict[str, dict] | None = None) -> tuple[Client, ClusterConfig]:
    """(client, config) of the workers of the shared cluster (tests/conftest.py) that
    offer `tag`, with `tag` as the config's resource. `changes` sets WorkerConfig
    fields by worker name ({"cpu-2": {"speed": 0.05}}); the caller registers them
    (`register_setup`) and sets the workers back when done."""
    client, config = shared
    workers = [dataclasses.replace(w, **(changes or {}).get(w.name, {}))
               for w in config.workers if tag in w.resources]
    return client, ClusterConfig(workers=workers, resource=tag)


def tiny_config(tmp_path, dataset: str, **overrides) -> RunConfig:
    """A small, fast run: conv 10 and 12 kernels, batch 16, 5 steps."""
    data = {
        "name": "tiny", "strategy": "kernel", "placement": "even", "progress": False,
        "output": str(tmp_path / "run"),
        "network": {"conv": [{"kernels": 10}, {"kernels": 12}], "dtype": "float32"},
        "data": {"path": dataset, "train_samples": 512, "test_samples": 128},
        "train": {"steps": 5, "batch": 16, "lr": 0.05, "momentum": 0.9,
                  "weight_decay": 0.001, "eval_samples": 64, "checkpoint_every": 0},
        "workspace": {"channel_quantum": 4},
    }
    overrides = [f"{k}={v}" for k, v in overrides.items()]
    return build_run_config(data, overrides)


def plain_pytorch_sequential(conv_widths: list[int], classes: int, dtype: torch.dtype,
                             image_hw: int = 32, hidden: tuple[int, ...] = ()) -> nn.Sequential:
    """The network written out by hand, as a user of plain PyTorch would."""
    modules: list[nn.Module] = []
    channels, size = 3, image_hw
    for width in conv_widths:
        modules += [nn.Conv2d(channels, width, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2)]
        channels, size = width, size // 2
    modules.append(nn.Flatten())
    features = channels * size * size
    for width in hidden:
        modules += [nn.Linear(features, width), nn.ReLU()]
        features = width
    modules.append(nn.Linear(features, classes))
    return nn.Sequential(*modules).to(dtype)


def _plain_model(config: RunConfig, dataset: str | None = None) -> nn.Module:
    """The run's network in plain PyTorch holding its step-0 checkpoint: written out
    by hand for the paper family's `conv` list, torchvision's (tests/torchvision_models.py,
    loaded strictly) for a zoo preset, the project's plain-PyTorch network
    (tasks/network.py, loaded strictly) for the `marques` preset or a user's own
    `layers`."""
    initial = checkpoints.read_tensors(config.checkpoint_path, 0)
    network = config.network
    if network.preset is not None and network.preset != "marques":  # torchvision's own
        return load_torchvision(network.preset, network.classes, network.width,
                                0.5 if network.dropout is None else network.dropout,
                                initial, network.dtype)
    if is_spec_network(config):
        shape = open_dataset_info(dataset or config.dataset_path).image_shape
        return load_model(config.network_spec(shape), initial)
    model = plain_pytorch_sequential([c.kernels for c in config.network.conv],
                                     config.network.classes, getattr(torch, config.network.dtype),
                                     hidden=tuple(config.network.hidden))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in initial.items()})
    return model


def is_spec_network(config: RunConfig) -> bool:
    """Whether the config's network is the zoo's or a user's own (`network.preset`,
    `network.layers`), which `tests.replica_replay` replays, rather than the paper
    family's `conv` list, which these helpers write out by hand."""
    return config.network.preset is not None or bool(config.network.layers)


def replay_model(config: RunConfig, dataset: str
                 ) -> tuple[nn.Module, torch.optim.SGD, list[float]]:
    """Re-run a training in plain single-process PyTorch from its step-0 checkpoint:
    the trained model, its optimizer and the per-step losses.

    Uses the checkpoint's recorded sample indices, so the batches are the same, each
    step's dropout masks (`set_dropout` with the run's seed and the step), and torch's
    own schedulers for the learning rate (`plain_scheduler`).
    """
    model = _plain_model(config, dataset)
    t = config.train
    optimizer = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum,
                                weight_decay=t.weight_decay)
    scheduler = plain_scheduler(optimizer, config)
    indices = checkpoints.read_sample_indices(config.checkpoint_path)
    losses = []
    for step in range(t.steps):
        images, labels = read_batch(dataset, "train", indices[step])
        optimizer.zero_grad()
        set_dropout(model, t.seed, step)
        loss = nn.functional.cross_entropy(model(augmented_batch(config, images, indices[step],
                                                                 step)),
                                           torch.from_numpy(labels))
        loss.backward()
        optimizer.step()
        step_schedulers(scheduler)
        losses.append(float(loss.detach()))
    return model, optimizer, losses


def replay_in_pytorch(config: RunConfig, dataset: str) -> tuple[dict, list[float]]:
    """`replay_model`'s final state_dict (numpy, as checkpoints keep it) and losses."""
    model, _, losses = replay_model(config, dataset)
    return to_arrays(model.state_dict(), config.network.dtype), losses


def replay_hybrid_in_pytorch(config: RunConfig, dataset: str, parts: list[list[int]],
                            conv_lr_scale: float = 1.0) -> tuple[dict, list[float]]:
    """Plain single-process PyTorch of the hybrid schedule with per-part dense updates.

    Per step: the conv layers forward on the whole batch; for each part (rows of the
    batch, in order) the dense layers forward on its rows, its mean loss backward and
    a dense SGD step; then the conv layers step once on the sum over parts of each
    part's feature gradient weighted by its share of the batch, at `conv_lr_scale`
    times the learning rate. Returns the final state_dict and per-step losses (the
    batch's mean loss, each part at the dense weights it met).
    """
    if is_spec_network(config):
        replay = replay_network(config, dataset, parts=parts, conv_lr_scale=conv_lr_scale)
        return replay.weights, replay.losses
    model = _plain_model(config)
    first_dense = next(i for i, m in enumerate(model) if isinstance(m, nn.Flatten)) + 1
    trunk, head = model[:first_dense], model[first_dense:]
    t = config.train

    def sgd(params, lr):
        return torch.optim.SGD(params, lr=lr, momentum=t.momentum, weight_decay=t.weight_decay)

    conv_opt = sgd(trunk.parameters(), t.lr * conv_lr_scale)
    dense_opt = sgd(head.parameters(), t.lr)
    schedulers = [plain_scheduler(conv_opt, config), plain_scheduler(dense_opt, config)]
    indices = checkpoints.read_sample_indices(config.checkpoint_path)
    losses = []
    for step in range(t.steps):
        images, labels = read_batch(dataset, "train", indices[step])
        x, y = augmented_batch(config, images, indices[step], step), torch.from_numpy(labels)
        conv_opt.zero_grad()
        features = trunk(x)
        grad_features = torch.zeros_like(features)
        total = 0.0
        for rows in parts:
            part = features.detach()[rows].requires_grad_(True)
            dense_opt.zero_grad()
            logits = head(part)
            summed = nn.functional.cross_entropy(logits.detach(), y[rows], reduction="sum")
            total += float(summed) / len(y)
            nn.functional.cross_entropy(logits, y[rows]).backward()
            dense_opt.step()
            grad_features[rows] = part.grad * (len(rows) / len(y))
        features.backward(grad_features)
        conv_opt.step()
        step_schedulers(*schedulers)
        losses.append(total)
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}, losses


def max_relative_error(state: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> float:
    """Largest per-tensor ||a - b|| / ||b|| over all tensors (keys must match)."""
    assert set(state) == set(expected), (sorted(state), sorted(expected))
    return max(float(np.linalg.norm(state[k] - expected[k]) / np.linalg.norm(expected[k]))
               for k in expected)


#: A tensor whose norm is below this is zero but for rounding: a conv's bias before batch
#: norm (the zoo's VGG with batch norm), whose gradient batch norm cancels (its mean is
#: subtracted), holds ~1e-19 after training, differently rounded on each device.
ROUNDING_ZERO = 1e-12


def assert_equal_within_rounding(state: dict[str, np.ndarray], expected: dict[str, np.ndarray],
                                 tolerance: float) -> None:
    """Every tensor within `tolerance` of `expected`'s, relative to its norm; one that is
    zero but for rounding (`ROUNDING_ZERO`) within `tolerance` absolute. Keys must match."""
    assert set(state) == set(expected), (sorted(state), sorted(expected))
    for key, want in expected.items():
        scale = float(np.linalg.norm(want))
        error = float(np.linalg.norm(state[key] - want))
        bound = tolerance * (scale if scale > ROUNDING_ZERO else 1.0)
        assert error <= bound, f"{key}: |a - b| = {error:.3g}, |b| = {scale:.3g}"


def run_main(cli: str, argv: list[str]) -> tuple[int, list[str], str]:
    """(exit status, non-empty stderr lines, stdout) of ``python -m pipeline.train``
    (`cli` "train") or ``python -m experiments.sweep`` ("sweep") run in this process."""
    main = train_cli.main if cli == "train" else sweep_cli.main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, [line for line in err.getvalue().splitlines() if line.strip()], out.getvalue()


def assert_one_error_line(status: int, lines: list[str], expected: int, names: str) -> None:
    """The CLI's promise for bad input: exit `expected`, one ``error:`` line naming it."""
    assert status == expected, (status, lines)
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ") and "Traceback" not in lines[0], lines
    assert names in lines[0], (names, lines[0])


def link_leftovers(run_id: str) -> list[str]:
    """What of links run `run_id` is still on this machine: namespaces, interfaces,
    processes."""
    found = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                       text=True).stdout.split() if run_id in n]
    found += [n for n in os.listdir("/sys/class/net") if run_id in n]
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        if f"hc{run_id}" in line and process.pid != os.getpid():
            found.append(line[:80])
    return found


def error_lines_of(text: str) -> list[str]:
    """The lines a run printed on stderr, less the start's notes on workers a
    placement left out (pipeline/records/summary.py, left_out_lines) and on setups of
    earlier runs it removed from a shared scheduler (an earlier test's stopped run
    leaves one): what a test of "one line" counts."""
    return [line for line in text.splitlines()
            if line.strip() and not (line.startswith("worker ") and " left out" in line)
            and not line.startswith("note: setting up the workers: removed the setup")]


def reliability_rows(section: str) -> list[list[str]]:
    """The table rows (cells stripped) of a section of docs/reliability.md, after its
    header and rule: what a test module's list of faults is compared with."""
    page = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "docs", "reliability.md")
    text = open(page, encoding="utf-8").read()
    assert section in text, f"{page} lacks the section {section!r}"
    body = text.split(section, 1)[1].split("\n## ", 1)[0]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in body.splitlines() if line.startswith("|")][2:]


def cut_probe_to_one_round(monkeypatch) -> None:
    """The model's probe cut to one round of the even plans and the replicas' (no share
    plans, no retimes, no plan budget): seconds, not a minute, where a test checks what
    a probe times or how it is keyed, not its figures (its robustness is
    tests/test_probe_robust.py's, the client's share tests/test_prediction.py's)."""
    import pipeline.probe.cluster as cluster_probe
    import pipeline.probe.rounds as rounds
    import pipeline.probe.runs as runs
    monkeypatch.setattr(cluster_probe, "share_plans", lambda *args: [])
    monkeypatch.setattr(runs, "ROUNDS", 1)
    monkeypatch.setattr(runs, "REPLICA_ROUNDS", 1)
    monkeypatch.setattr(rounds, "RETIMES", 0)
    monkeypatch.setattr(cluster_probe, "plans_for",
                        lambda *args: runs.plans_for(*args, budget_s=0.0))


#: docs/outputs.md, whose `## summary.json` section names every key of a summary.
OUTPUTS_PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "docs", "outputs.md")


def summary_keys_documented() -> set[str]:
    """The keys docs/outputs.md's `## summary.json` table names (its first column)."""
    import re
    text = open(OUTPUTS_PAGE, encoding="utf-8").read()
    section = text.split("\n## summary.json\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {key for row in rows for key in re.findall(r"`([a-z_0-9]+)`", row)}


def undocumented_summary_keys(summary: dict) -> set[str]:
    """The keys of a run's summary that docs/outputs.md does not name."""
    return set(summary) - summary_keys_documented()
