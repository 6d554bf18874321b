"""Every bad input to the two command lines: one line on stderr naming it, exit 2 or 1.

The table runs each case through `main(argv)` in-process, exactly as the command
line would (no `--check`: a case that slipped past the pre-flight checks would go
on to train, and fail this test by its output or its time); a few more run as real
subprocesses. docs/reliability.md quotes the count of cases, and
`test_reliability_page_counts_these_cases` keeps it current.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace

import pytest
import yaml

from experiments.sweep import cli as sweep_cli
from experiments.sweep.config import load_sweep
from experiments.sweep.results import ResultStore
from experiments.sweep.store_layout import build_template
from pipeline import train as train_cli
from pipeline.config.run_config import load_run_config
from pipeline.placement.split import PlacementError
from pipeline.config.schema import ConfigError, yaml_load
from tests.helpers import assert_one_error_line, run_main
from tests.test_bad_input_properties import BUDGETS
from tests.test_scaling import write_scaling
from tests.test_datasets import _cifar_batches as cifar_batches, _write_archive as write_cifar_archive

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = os.path.join(ROOT, "configs", "small.yaml")
QUICK = os.path.join(ROOT, "experiments", "configs", "quick.yaml")
SCALING = os.path.join(ROOT, "experiments", "configs", "scaling.yaml")
PAGE = os.path.join(ROOT, "docs", "reliability.md")


@dataclass(frozen=True)
class Case:
    """One bad command line: which CLI, its arguments, the exit status and what the
    one line must name. ``{tmp}`` in an argument is the test's temporary folder,
    ``{dataset}`` the tiny dataset store."""

    cli: str  # "train" or "sweep"
    args: tuple[str, ...]
    status: int
    names: str
    env: dict[str, str] = field(default_factory=dict)
    # Found only once the run has begun (its output directory exists by then): the
    # archive is read whole when the dataset is built, too costly to read twice.
    after_start: bool = False

    @property
    def id(self) -> str:
        return f"{self.cli}:{' '.join(self.args)}"[:80]


def train_case(*args: str, names: str, status: int = 2, **env: str) -> Case:
    """A `pipeline.train` case on the small config, writing under the temporary folder."""
    return Case("train", (SMALL, "output={tmp}/run", *args), status, names, env)


def sweep_case(*args: str, names: str, config: str = QUICK, status: int = 2, **env: str
               ) -> Case:
    return Case("sweep", (config, *args), status, names, env)


CASES: list[Case] = [
    # Output directories: unwritable, under a file, a file.
    train_case("output=/proc/x", names="output"),
    train_case("output=/dev/null/x", names="output"),
    train_case("output={tmp}/a-file", names="output"),
    train_case("workspace.path=/proc/x", names="workspace.path"),
    # Numbers out of range (validated in pipeline/config/run_config.py __post_init__s).
    train_case("train.lr=-1", names="train.lr"),
    train_case("train.lr=0", names="train.lr"),
    train_case("train.lr=.inf", names="train.lr"),
    train_case("train.momentum=1", names="train.momentum"),
    train_case("train.momentum=-0.5", names="train.momentum"),
    train_case("train.weight_decay=-1e-4", names="train.weight_decay"),
    train_case("train.weight_decay=.nan", names="train.weight_decay"),
    train_case("train.steps=0", names="train.steps"),
    train_case("train.batch=-8", names="train.batch"),
    train_case("train.inflight=0", names="train.inflight"),
    train_case("train.steps_per_task=0", names="train.steps_per_task"),
    train_case("train.steps_per_task=sometimes", names="train.steps_per_task"),
    train_case("train.steps_per_task=4", "workspace.sync=scheduler",
               names="train.steps_per_task"),
    train_case("strategy=data", "network.preset=resnet20", "workspace.sync=scheduler",
               names="train.batch_norm: sync"),
    # Batch norm on one value per channel: ResNet-18's layer4 sees 1x1 features on
    # 32-pixel images, so a batch of one cannot train it, whatever the strategy.
    *[train_case("network.preset=resnet18", "network.width=0.125", f"strategy={strategy}",
                 "train.batch=1", *more, names="train.batch: a batch of 1 gives batch "
                 "norm layer4.0.bn1")
      for strategy, more in (("reference", ()), ("single", ()), ("kernel", ()),
                             ("data", ()), ("hybrid", ()),
                             ("data", ("train.batch_norm=local",)))],
    # Hybrid gives every worker some of each dense layer's neurons: refused before the
    # workers start (they did start, and were timed, before the run refused it).
    train_case("strategy=hybrid", "cluster.workers=3", "network.hidden=[1]",
               names="network.hidden.0: strategy hybrid splits every dense layer's neurons "
               "over its workers, at least one each, and this layer has 1 for 3 workers"),
    train_case("strategy=hybrid", "cluster.workers=3", "network.hidden=[4, 2]",
               names="network.hidden.1: strategy hybrid splits"),
    train_case("train.seed=-1", names="train.seed"),
    train_case("train.eval_samples=-1", names="train.eval_samples"),
    train_case("train.nesterov=true", "train.momentum=0", names="train.nesterov"),
    train_case("train.lr_decay=linear", names="train.lr_decay"),
    train_case("train.lr_decay=step", names="train.lr_milestones: train.lr_decay: step needs"),
    train_case("train.lr_decay=step", "train.lr_milestones=[30, 10]",
               names="train.lr_milestones: expected increasing"),
    train_case("train.lr_decay=step", "train.lr_milestones=[3]", "train.lr_warmup=5",
               names="train.lr_milestones: milestone 3 is within the warm-up"),
    train_case("train.lr_milestones=[3]", names="train.lr_milestones: milestones [3] are for"),
    train_case("train.lr_gamma=0", names="train.lr_gamma"),
    train_case("train.lr_warmup_factor=0", names="train.lr_warmup_factor"),
    train_case("train.lr_decay=cosine", "train.lr_warmup=60", names="train.lr_warmup: 60"),
    train_case("network.conv.0.kernels=0", names="network.conv.0.kernels"),
    train_case("network.conv.1.padding=-1", names="network.conv.1.padding"),
    train_case("network.hidden=[64, 0]", names="network.hidden.1"),
    train_case("network.classes=0", names="network.classes"),
    # A zoo network too big for the images (AlexNet's strided stem wants 63 pixels).
    train_case("network.preset=alexnet", names="network.preset: alexnet does not fit"),
    train_case("network.conv=[]", names="network.conv"),
    train_case("cluster.workers=0", names="cluster.workers"),
    # a count of 2 beside devices, which make the workers (it passed: 2 is the default)
    train_case("cluster.devices=[cpu]", "cluster.workers=2",
               names="cluster.devices: set either cluster.devices or cluster.workers"),
    # a count beside a scheduler you started (it was ignored: all its workers trained)
    train_case("cluster.workers=2", "--scheduler", "tcp://127.0.0.1:9",
               names="cluster.workers: 2 counts the workers of the embedded cluster"),
    train_case("cluster.workers=[{speed: 0}]", names="cluster.workers.0.speed"),
    train_case("cluster.workers=[{threads: 0}]", names="cluster.workers.0.threads"),
    train_case("cluster.workers=[{resources: {CPU: -1}}]", names="cluster.workers.0.resources"),
    train_case("cluster.use_workers=0", names="cluster.use_workers"),
    train_case("cluster.memory_margin=-0.1", names="cluster.memory_margin"),
    # a folder that is no dataset store (a run's record.zarr, say): --check passed it
    train_case("data.path=" + os.path.join(ROOT, "configs"),
               names="data.path: " + os.path.join(ROOT, "configs") + " exists and it is not"),
    # Two workers of one name: Dask keeps one, so the run trained on one of two.
    train_case("cluster.workers=[{name: a}, {name: a}]",
               names="cluster.workers.1.name: 'a' is already used (by cluster.workers.0)"),
    train_case("--check", "cluster.workers=[{name: a}, {name: a}]",
               names="cluster.workers.1.name: 'a' is already used (by cluster.workers.0)"),
    train_case("cluster.workers=[{name: cpu-1}, {}]",
               names="cluster.workers.1.name: its default name 'cpu-1' is already used "
               "(by cluster.workers.0)"),
    # What the embedded cluster's workers are is known from the config: a master none
    # of them is, or a CUDA device the machine lacks, is refused before it starts.
    train_case("--check", "cluster.workers=3", "cluster.master=nosuch",
               names="cluster.master: no worker of the embedded cluster is named or tagged "
               "'nosuch' (workers: cpu-0, cpu-1, cpu-2)"),
    train_case("cluster.master=GPU", names="cluster.master: no worker of the embedded cluster "
               "is named or tagged 'GPU' (workers: cpu-0, cpu-1)"),
    train_case("--check", "cluster.devices=[cuda:15, cpu]",
               names="cluster.devices: worker gpu-0 wants cuda:15, but this machine has"),
    train_case("cluster.workers=[{}, {device: 'cuda:15', resources: {GPU: 1}}]",
               names="cluster.workers: worker gpu-1 wants cuda:15, but this machine has"),
    # its only worker on a GPU (tagged GPU), the run asking CPU: the device is the cause
    # a per-part dense update of scheme a, which has one part: it would change nothing
    train_case("strategy=hybrid", "hybrid.dense_batch=worker",
               names="hybrid.dense_batch: `worker` steps the dense layers after each part"),
    train_case("--check", "cluster.workers=[{device: 'cuda:15'}]",
               names="cluster.workers: worker gpu-0 wants cuda:15, but this machine has"),
    # --check asks the scheduler it names, as the run's start does (exit 1, its line)
    train_case("--check", "--scheduler", "tcp://127.0.0.1:9", status=1,
               names="cannot reach the Dask scheduler at tcp://127.0.0.1:9"),
    train_case("cluster.jobqueue.walltime=1h",
               names="cluster.jobqueue.walltime: expected HH:MM:SS (Slurm also D-HH:MM:SS), "
               "got '1h'"),
    train_case("cluster.wait_timeout=-1", names="cluster.wait_timeout"),
    train_case("workspace.wait_timeout=0", names="workspace.wait_timeout"),
    train_case("workspace.channel_quantum=0", names="workspace.channel_quantum"),
    train_case("reference.threads=0", names="reference.threads"),
    train_case("data.train_samples=0", names="data.train_samples"),
    train_case("data.augment=crop", names="data.augment: expected one of 'none', 'crop_flip'"),
    # A crop from padding as wide as the image may hold none of it.
    train_case("data.augment=crop_flip", "data.augment_padding=32",
               names="data.augment_padding: 32 pixels of padding let a crop of a 32x32 image"),
    # What the dataset and a recorded split's summary say, known from files alone: once
    # refused only after the dataset was built, or the cluster started.
    train_case("network.classes=5", names="network.classes: 5, but the dataset has 10 classes"),
    train_case("train.batch=6000",
               names="train.batch: 6000 is larger than the 5000 training samples"),
    train_case("placement=recorded", "split_from={tmp}/nowhere",
               names="split_from: cannot read a run summary at {tmp}/nowhere"),
    # `--check` refuses them in the run's words (the two cases above).
    train_case("network.classes=5", "--check",
               names="network.classes: 5, but the dataset has 10 classes"),
    train_case("placement=recorded", "split_from=/nonexistent", "--check",
               names="split_from: cannot read a run summary at /nonexistent"),
    # Wrong keys, types and values.
    train_case("train.stepz=3", names="train.stepz: unknown key"),
    train_case("train.steps=many", names="train.steps: expected an integer"),
    train_case("train.steps=2.5", names="train.steps"),
    train_case("network.dtype=float16", names="network.dtype"),
    train_case("strategy=magic", names="strategy"),
    train_case("placement=model", "strategy=data", names="placement"),
    train_case("name=", names="name"),
    train_case("train.lr", names="train.lr"),  # no '='
    train_case("network.conv.5.kernels=8", names="network.conv.5"),
    # Scheduler addresses.
    train_case("--scheduler", "notaurl", names="cluster.scheduler"),
    train_case("--scheduler", "foo://host:8786", names="cluster.scheduler"),
    train_case("--scheduler", "tcp://host:99999", names="cluster.scheduler"),
    train_case(names="DASK_SCHEDULER_ADDRESS", DASK_SCHEDULER_ADDRESS="not a url"),
    # Workers listed for the embedded cluster, with a scheduler you started: its workers
    # trained as they were (a listed `speed: 0.5` at full speed, every worker joining).
    train_case("--scheduler", "tcp://127.0.0.1:9", "cluster.workers=[{name: a}, {speed: 0.5}]",
               names="cluster.workers: lists the workers of the embedded cluster a run "
               "starts (names, emulated speeds, threads, devices, memory limits), but "
               "cluster.scheduler names a scheduler you started"),
    train_case("cluster.devices=[cpu, cpu]", names="cluster.devices: lists the workers "
               "of the embedded cluster a run starts", DASK_SCHEDULER_ADDRESS="tcp://127.0.0.1:9"),
    # The probe's environment: its policy and how long a cached probe stands.
    train_case(names="CNN_PROBE_MAX_AGE='soon'", CNN_PROBE_MAX_AGE="soon"),
    train_case(names="CNN_PREDICT_PROBE='sometimes'", CNN_PREDICT_PROBE="sometimes"),
    sweep_case("--out", "{tmp}/q.zarr", names="CNN_PROBE_MAX_AGE='-1h'",
               CNN_PROBE_MAX_AGE="-1h"),
    # The command line itself.
    train_case("--bogus", names="--bogus"),
    train_case("--scheduler", names="--scheduler"),
    Case("train", (), 2, "config"),
    # Config files: a folder, missing, binary, not YAML, duplicate keys, not a mapping.
    Case("train", (os.path.join(ROOT, "configs"),), 2, "configs"),
    Case("train", ("{tmp}/missing.yaml",), 2, "missing.yaml"),
    Case("train", ("{tmp}/binary.yaml",), 2, "binary.yaml"),
    Case("train", ("{tmp}/broken.yaml",), 2, "broken.yaml"),
    Case("train", ("{tmp}/twice.yaml",), 2, "duplicate key 'train'"),
    Case("train", ("{tmp}/list.yaml",), 2, "list.yaml"),
    Case("train", ("{tmp}/wrong-type.yaml",), 2, "network.conv.0.kernels: expected an integer"),
    # Datasets: a store path under a file or that is a file, a missing or damaged source.
    train_case("data.path=/dev/null/x.zarr", names="data.path"),
    train_case("data.path={tmp}/a-file", names="data.path"),
    train_case("data.source={tmp}/nowhere/cifar-10-python.tar.gz",
               "data.path={tmp}/cifar.zarr",
               names="data.source: {tmp}/nowhere/cifar-10-python.tar.gz does not exist"),
    # a file that is no tar archive: refused before the run starts, by --check too
    train_case("data.source={tmp}/junk.tar.gz", "data.path={tmp}/cifar.zarr",
               names="data.source: {tmp}/junk.tar.gz is a file but no tar archive"),
    train_case("--check", "data.source={tmp}/junk.tar.gz",
               names="data.source: {tmp}/junk.tar.gz is a file but no tar archive"),
    # more samples than a (small) CIFAR-10 archive holds: known once it is read
    replace(train_case("data.source={tmp}/cifar-10-python.tar.gz", "data.path={tmp}/c.zarr",
                       "data.train_samples=100000",
                       names="data.train_samples: 100000, but {tmp}/cifar-10-python.tar.gz "
                             "holds"),
            after_start=True),
    # Runtime (exit 1): nothing listens at the scheduler's address.
    replace(train_case("data.path={dataset}", "data.train_samples=512",
                       "data.test_samples=128", "--scheduler",  # the store as it is built
                       "tcp://127.0.0.1:9",
                       names="cannot reach the Dask scheduler at tcp://127.0.0.1:9", status=1),
            after_start=True),
    # The sweep: its store, its options, its keys and its base.
    sweep_case("base=", names="base: expected a run config"),  # was "...: is a directory"
    sweep_case("base={tmp}", names="base: "),
    sweep_case("--out", "/proc/x", names="--out"),
    sweep_case("--out", "/dev/null/x", names="--out"),
    sweep_case("--out", "{tmp}/a-file", names="--out"),
    sweep_case("--out", "{tmp}/q.zarr", "--fresh", "--extend", names="--fresh --extend"),
    sweep_case("mode=predict", names="mode: ", config=SCALING),
    sweep_case("mode=scaling", names="mode: "),
    # Run names: one folder's name of at most 100 safe characters, checked by --check too.
    train_case("name=a/b", names="name: 'a/b' has characters"),
    train_case("name=..", names="name: '..' is not a folder's name"),
    train_case("--check", "name=" + "x" * 300, names="name: 300 characters"),
    train_case("--check", "name=" + "x" * 100_000, names="name: 100000 characters"),
    Case("train", ("{tmp}/huge.yaml", "--check"), 2, "too large for a config"),
    sweep_case("output=/dev/null/q.zarr", names="output"),
    sweep_case("--out", "{tmp}/q.zarr", "--scheduler", "notaurl", names="cluster.scheduler"),
    sweep_case("--out", "{tmp}/q.zarr", "repeats=0", names="repeats"),
    sweep_case("--out", "{tmp}/q.zarr", "measure.steps=0", names="measure.steps"),
    sweep_case("--out", "{tmp}/q.zarr", "train.lr=-1", names="train.lr"),
    sweep_case("--out", "{tmp}/q.zarr", "axes.train.lr=[0.1, -1]", names="axes.train.lr"),
    sweep_case("--out", "{tmp}/q.zarr", "axes.train.momentum=1", names="axes.train.momentum"),
    sweep_case("--out", "{tmp}/q.zarr", "axes.cluster.workers=[1, [{name: a}, {name: a}]]",
               names="cluster.workers.1.name: 'a' is already used (by cluster.workers.0)"),
    sweep_case("--out", "{tmp}/q.zarr", "data.path=/dev/null/x.zarr", names="data.path"),
    sweep_case("--out", "{tmp}/q.zarr", "--fresh", "--bogus", names="--bogus"),
    Case("sweep", ("{tmp}/nobase.yaml", "--dry-run"), 2, "missing.yaml"),
    Case("sweep", (os.path.join(ROOT, "experiments", "configs"),), 2, "configs"),
    Case("sweep", ("{tmp}/twice.yaml", "--dry-run"), 2, "duplicate key"),
    sweep_case("--out", "/proc/x", names="--out", config=SCALING),
    sweep_case("--scheduler", "tcp://h:8786", names="--scheduler", config=SCALING),
]


@pytest.fixture()
def workdir(tmp_path, monkeypatch, tiny_dataset_factory):
    """A temporary working folder holding the files the cases name; the cases run
    from it, so nothing they might write lands in the repository."""
    (tmp_path / "a-file").write_text("not a folder\n")
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)))
    (tmp_path / "broken.yaml").write_text("train: {steps: [1, 2\n")
    (tmp_path / "twice.yaml").write_text("train: {steps: 3}\nstrategy: single\n"
                                         "train: {batch: 8}\n")
    (tmp_path / "list.yaml").write_text("- train\n- steps\n")
    (tmp_path / "wrong-type.yaml").write_text("network:\n  conv:\n    - {kernels: lots}\n")
    (tmp_path / "nobase.yaml").write_text("base: missing.yaml\naxes: {strategy: [kernel]}\n")
    (tmp_path / "huge.yaml").write_text("name: " + "x" * 4_000_000 + "\n")
    (tmp_path / "junk.tar.gz").write_bytes(b"\x1f\x8b not really gzip\n" * 4)
    write_cifar_archive(tmp_path / "cifar-10-python.tar.gz", cifar_batches())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CNN_PREDICT_PROBE", "never")
    monkeypatch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))
    monkeypatch.delenv("DASK_SCHEDULER_ADDRESS", raising=False)
    return tmp_path, tiny_dataset_factory("float32")


def assert_one_line(status: int, lines: list[str], case: Case) -> None:
    assert_one_error_line(status, lines, case.status, case.names)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_bad_input_is_one_line(case, workdir, monkeypatch):
    tmp, dataset = workdir
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    args = [a.replace("{tmp}", str(tmp)).replace("{dataset}", dataset) for a in case.args]
    status, lines, _out = run_main(case.cli, args)
    assert_one_line(status, lines, replace(case, names=case.names.replace("{tmp}", str(tmp))))
    if not case.after_start:
        assert not (tmp / "run").exists()  # refused before anything was written


def test_placement_error_reaching_the_cli_is_one_line(workdir, monkeypatch):
    """More workers than kernels is refused by the placement once the cluster is up
    (being redesigned); whatever raises it, the CLI shows one line and exit 2."""
    def refuse(config):
        raise PlacementError("4 kernels in units of 4 cannot feed 3 workers:\n"
                             "lower workspace.channel_quantum or use fewer workers")
    monkeypatch.setattr(train_cli, "run_training", refuse)
    status, lines, _out = run_main("train", [SMALL, f"output={workdir[0]}/run"])
    assert_one_line(status, lines, Case("train", (), 2, "cannot feed 3 workers"))


def test_a_disk_failure_during_a_run_is_one_line_exit_1(workdir, monkeypatch):
    def disk_full(config):
        raise OSError(28, "No space left on device", f"{config.output_dir}/record.zarr")
    monkeypatch.setattr(train_cli, "run_training", disk_full)
    status, lines, _out = run_main("train", [SMALL, f"output={workdir[0]}/run"])
    assert_one_line(status, lines, Case("train", (), 1, "No space left on device"))


# Real processes: what a user sees, from the interpreter's start to its exit. Each is an
# interpreter importing torch, and the table checks the same refusals in-process: the
# train command's here; the sweep command's (a dry run refused in one line, exit 2) are
# the first runs of the two dry-run tests below, which also meet a store or a point.

SUBPROCESS_CASES = [
    Case("train", (SMALL, "train.lr=1e-3", "--scheduler", "notaurl", "output=/proc/x"), 2,
         "cluster.scheduler"),
]


@pytest.mark.parametrize("case", SUBPROCESS_CASES, ids=lambda case: case.id)
def test_bad_input_through_the_real_command(case, tmp_path):
    module = "pipeline.train" if case.cli == "train" else "experiments.sweep.cli"
    env = {**os.environ, "PYTHONPATH": ROOT, "CNN_PREDICT_PROBE": "never"}
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    result = subprocess.run([sys.executable, "-m", module, *case.args], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120, env=env)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert_one_line(result.returncode, lines, case)


#: `python -m pipeline.train ARGS` through runpy in a fresh interpreter, saying at its
#: exit its status and which of the imports a run needs it had made.
AS_THE_COMMAND = (
    "import runpy, sys\n"
    "sys.argv = ['pipeline.train', *sys.argv[1:]]\n"
    "try:\n"
    "    runpy.run_module('pipeline.train', run_name='__main__', alter_sys=True)\n"
    "except SystemExit as stop:\n"
    "    heavy = [name for name in ('torch', 'xarray') if name in sys.modules]\n"
    "    print('status', stop.code, 'imported', heavy)\n")


def test_help_and_wrong_input_are_answered_before_the_runs_imports(tmp_path):
    """`--help`, a wrong option and a config's wrong field are answered before the
    command imports torch or xarray (half a second, not five), each as `main` answers
    it; a config that reads is left to `main`, which imports them."""
    cases = [(["--help"], 0), ([SMALL, "train.lr=abc"], 2), ([SMALL, "--bogus"], 2)]
    for args, status in cases:
        result = subprocess.run([sys.executable, "-c", AS_THE_COMMAND, *args], cwd=tmp_path,
                                capture_output=True, text=True, timeout=120,
                                env={**os.environ, "PYTHONPATH": ROOT})
        assert f"status {status} imported []" in result.stdout, (args, result.stdout,
                                                               result.stderr)
        if status:
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            assert lines == run_main("train", args)[1], (args, lines)
    assert train_cli.answer_before_imports([SMALL, "train.steps=3"]) is None


def sweep_process(*args: str, cwd: str) -> subprocess.CompletedProcess:
    """``python -m experiments.sweep ARGS`` as a user runs it, from `cwd`."""
    env = {**os.environ, "PYTHONPATH": ROOT, "CNN_PREDICT_PROBE": "never"}
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "experiments.sweep", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120, env=env)


def write_zoo_sweep(tmp_path, presets: list[str]) -> str:
    """A sweep over zoo networks on 32-pixel synthetic images, in this process only
    (`reference`: no cluster), small enough that a run of it takes seconds."""
    config = {"name": "zoo",
              "base": {"strategy": "reference",
                       "network": {"preset": "resnet20", "width": 0.125},
                       "data": {"source": "synthetic", "path": str(tmp_path / "zoo-data.zarr"),
                                "train_samples": 64, "test_samples": 16},
                       "train": {"batch": 13, "eval_samples": 0, "checkpoint_every": 0}},
              "measure": {"warmup_steps": 1, "steps": 1},
              "axes": {"network.preset": {"dim": "network", "values": presets},
                       "train.lr": [0.05, 0.1]}}
    path = tmp_path / "zoo.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


def sweep_in_process(monkeypatch, tmp_path, *args: str) -> tuple[int, list[str], str]:
    """`run_main("sweep", ARGS)` from `tmp_path` with `sweep_process`'s environment (its
    probe policy, no scheduler from the environment), undone after: where a test runs
    the command once as a process, its other runs here (an interpreter and its imports
    less each; what only a process shows, the first one shows)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CNN_PREDICT_PROBE", "never")
    monkeypatch.delenv("DASK_SCHEDULER_ADDRESS", raising=False)
    return run_main("sweep", list(args))


def sweep_either_way(as_process: bool, monkeypatch, tmp_path,
                     *args: str) -> tuple[int, list[str], str]:
    """The sweep command's (status, non-blank stderr lines, stdout): as a process
    (`sweep_process`) or through its `main` here (`sweep_in_process`)."""
    if not as_process:
        return sweep_in_process(monkeypatch, tmp_path, *args)
    result = sweep_process(*args, cwd=str(tmp_path))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    return result.returncode, lines, result.stdout


def test_dry_run_refuses_another_sweeps_store_as_the_run_does(tmp_path, monkeypatch):
    """The dry run once listed the points (without their status) and exited 0 where
    the run refuses the store: it checks the store first, in the run's line. The
    first difference through the real command, the others through its `main` here."""
    config = write_zoo_sweep(tmp_path, ["resnet20"])
    store = str(tmp_path / "zoo.zarr")
    sweep = load_sweep(config, out=store)
    ResultStore(store).create(build_template(sweep, {"fingerprint": sweep.fingerprint,
                                                     "config": sweep.text}))
    before = sorted(p.name for p in (tmp_path / "zoo.zarr").iterdir())
    # each field by its dotted name and the values as the user wrote them: not the
    # base's derived train.steps (warm-up added in), nor a YAML line of a list
    for number, (override, difference) in enumerate([
            ("train.batch=12", "base.train.batch: 13 there, 12 here"),
            ("measure.steps=4", "measure.steps: 1 there, 4 here"),
            ("axes.train.lr=[0.05]", "axes.train.lr: [0.05, 0.1] there, [0.05] here")]):
        status, lines, stdout = sweep_either_way(number == 0, monkeypatch, tmp_path, config,
                                                 "--out", store, override, "--dry-run")
        assert_one_error_line(status, lines, 2,
                              f"holds a different sweep (first difference: {difference})")
        assert stdout == ""  # no list of points
    assert sorted(p.name for p in (tmp_path / "zoo.zarr").iterdir()) == before
    # --fresh would replace it: the dry run lists the points, as the run would run them
    status, lines, out = run_main("sweep", [config, "--out", store, "train.batch=12",
                                            "--dry-run", "--fresh"])
    assert status == 0 and "2 points" in out, lines


def test_scaling_dry_run_refuses_another_sweeps_store_as_the_run_does(tmp_path):
    store = str(tmp_path / "scale.zarr")
    config = write_scaling(tmp_path, {"strategy": ["single", "kernel"]})
    assert run_main("sweep", [config, "--out", store])[0] == 0
    other = write_scaling(tmp_path, {"strategy": ["single", "data"]}, name="other")
    for argv in ([other, "--out", store], [other, "--out", store, "--dry-run"]):
        status, lines, out = run_main("sweep", argv)
        assert_one_error_line(status, lines, 2, "holds a different sweep")
    assert "2 points" in run_main("sweep", [other, "--out", store, "--dry-run", "--fresh"])[2]


def test_a_sweep_with_a_point_its_run_would_refuse_runs_no_point(tmp_path, monkeypatch):
    """AlexNet does not fit 32-pixel images: `pipeline.train --check` refuses it alone,
    and a sweep with it among its points once ran the others and recorded it as
    failed. Now the sweep (and its dry run) stops first, naming the point, and
    writes no store. The dry run through the real command, the run through its `main`
    here."""
    config = write_zoo_sweep(tmp_path, ["resnet20", "alexnet"])
    store = tmp_path / "zoo.zarr"
    for dry in (["--dry-run"], []):
        status, lines, stdout = sweep_either_way(bool(dry), monkeypatch, tmp_path, config,
                                                 "--out", str(store), *dry)
        assert_one_error_line(status, lines, 2,
                              "network.preset: alexnet does not fit images of 32x32")
        assert lines[0].endswith("(at point network=alexnet lr=0.05)"), lines
        assert stdout == ""
        assert not store.exists() and not (tmp_path / "zoo.runs").exists()
    assert not (tmp_path / "zoo-data.zarr").exists()  # no dataset built either


# YAML numbers as YAML 1.2 reads them, in files and in overrides.

def test_yaml_12_floats_in_config_files_and_overrides(tmp_path):
    config = tmp_path / "exp.yaml"
    config.write_text("train: {lr: 5e-2, weight_decay: 1E-4, momentum: 9.0e-1, steps: 1e1}\n")
    with pytest.raises(ConfigError, match="train.steps: expected an integer, got 10.0"):
        load_run_config(str(config))  # 1e1 is a float: steps wants an integer
    config.write_text("train: {lr: 5e-2, weight_decay: 1E-4, momentum: 9.0e-1}\n")
    loaded = load_run_config(str(config), ["train.lr=1e-3"])
    assert loaded.train.lr == 1e-3 and isinstance(loaded.train.lr, float)
    assert loaded.train.weight_decay == 1e-4 and loaded.train.momentum == 0.9
    assert load_run_config(str(config)).train.lr == 0.05
    # Ints stay ints, text stays text, YAML 1.1 floats still read.
    assert yaml_load("[10, 1_000, 2.5, .5, -3e+2, e5, 1e, 1.5e3x]") == \
        [10, 1000, 2.5, 0.5, -300.0, "e5", "1e", "1.5e3x"]
    # safe_load, as PyYAML has it, still reads 1e-3 as text: the loader is what fixes it.
    assert yaml.safe_load("1e-3") == "1e-3"


def test_yaml_12_floats_on_a_sweep_axis(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CNN_PREDICT_PROBE", "never")
    monkeypatch.chdir(tmp_path)
    status = sweep_cli.main([QUICK, "--dry-run", "--out", str(tmp_path / "q.zarr"),
                             "axes.train.lr=[1e-3, 5e-2]", "axes.strategy=[kernel]",
                             "axes.cluster.workers=[2]"])
    out = capsys.readouterr().out
    assert status == 0
    assert "lr=0.001" in out and "lr=0.05" in out


# Options and overrides in any order.

TRAIN_ORDERS = [
    [SMALL, "--scheduler", "tcp://127.0.0.1:8786", "train.lr=1e-3", "--check"],
    ["--check", SMALL, "train.lr=1e-3", "--scheduler", "tcp://127.0.0.1:8786"],
    ["--check", "--scheduler", "tcp://127.0.0.1:8786", SMALL, "train.lr=1e-3"],
    [SMALL, "train.lr=1e-3", "--scheduler=tcp://127.0.0.1:8786", "--check"],
]


@pytest.mark.parametrize("argv", TRAIN_ORDERS, ids=range(len(TRAIN_ORDERS)))
def test_train_options_and_overrides_in_any_order(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config, check_only = train_cli.load_checked(argv)
    assert check_only and config.train.lr == 1e-3
    assert config.cluster.scheduler == "tcp://127.0.0.1:8786"


SWEEP_ORDERS = [
    [QUICK, "--dry-run", "axes.train.batch=[32,64]"],  # the README's example
    ["--dry-run", QUICK, "axes.train.batch=[32,64]"],
    [QUICK, "axes.train.batch=[32,64]", "--dry-run"],
    [QUICK, "axes.train.batch=[32,64]", "--dry-run", "repeats=2", "--fresh"],
]


@pytest.mark.parametrize("argv", SWEEP_ORDERS, ids=range(len(SWEEP_ORDERS)))
def test_sweep_options_and_overrides_in_any_order(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CNN_PREDICT_PROBE", "never")
    monkeypatch.chdir(tmp_path)
    status = sweep_cli.main([*argv, "--out", str(tmp_path / "q.zarr")])
    out = capsys.readouterr().out
    repeats = 2 if "repeats=2" in argv else 1
    assert status == 0
    # quick.yaml: 6 strategies x 2 worker counts, now x 2 batch sizes.
    assert (f"{24 * repeats} points (6 strategy x 2 workers x 2 batch x {repeats} repeat(s))"
            in out)
    assert not (tmp_path / "q.zarr").exists()  # a dry run writes nothing


def test_scaling_sweep_options_and_overrides_in_any_order(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = write_scaling(tmp_path, {"strategy": ["single", "kernel"]})
    store = str(tmp_path / "s.zarr")
    for argv in ([config, "--dry-run", "axes.hardware.devices=[1,2]", "--out", store],
                 ["--dry-run", config, "--out", store, "axes.hardware.devices=[1,2]"],
                 ["--out", store, config, "axes.hardware.devices=[1,2]", "--dry-run"]):
        assert sweep_cli.main(argv) == 0, capsys.readouterr().err
        assert "4 points (2 strategy x 2 devices)" in capsys.readouterr().out
    assert not os.path.exists(store)


# The reliability page states how many bad inputs these tests try.

def test_a_name_of_megabytes_is_refused_at_once():
    """Its length is checked before the override is parsed (YAML took minutes)."""
    start = time.perf_counter()
    status, lines, _out = run_main("train", [SMALL, "--check", "name=" + "x" * 50_000_000])
    assert time.perf_counter() - start < 5
    assert_one_error_line(status, lines, 2, "name: 50000000 characters")


def test_reliability_page_counts_these_cases():
    text = open(PAGE, encoding="utf-8").read()
    section = text.split("## Bad input", 1)[1].split("\n## ", 1)[0]
    table = re.search(r"(\d+) bad inputs? in a table", section)
    processes = re.search(r"(\d+) more as (?:a )?real process", section)
    assert table and int(table.group(1)) == len(CASES) + 2, section  # + the two raise tests
    assert processes and int(processes.group(1)) == len(SUBPROCESS_CASES), section
    properties = re.search(r"(\d+) properties\s+on at most (\d+) generated inputs", section)
    assert properties, section
    assert int(properties.group(1)) == len(BUDGETS), section
    assert int(properties.group(2)) == sum(BUDGETS.values()), section


@pytest.mark.parametrize("command, required", [("train", "config"), ("sweep", "config")])
def test_a_command_without_arguments_names_only_what_is_required(command, required):
    """argparse listed the optional overrides (`nargs="*"`) as required too:
    `the following arguments are required: config, overrides`."""
    status, lines, _out = run_main(command, [])
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: the following arguments are required: {required} (see")
