"""Sweeps as a user meets them: the CLI, the store read back with xarray, resume after
SIGKILL, a refused concurrent sweep, failed points, and bad configs (exit 2).

Points are tiny (conv 8/8, batch <= 16, 1 warm-up + 2 measured steps) so the real
embedded clusters, not the training, set the pace.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import warnings
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
import xarray as xr
import yaml

from experiments.report.markdown import trained_on
from experiments.sweep import cli as sweep_cli
from experiments.sweep.results import ResultStore, SweepLock
from experiments.sweep.store_layout import DONE, FAILED, SKIPPED, build_template
from experiments.sweep.speedup import compute_speedup, speedup_caveat
from experiments.sweep.summary import format_table, repeat_spread_of, summary_table
from experiments.sweep.axes import SWEEP_FILE_KEYS, build_axes, value_label
from experiments.scaling.config import ScalingPoint, ScalingSweepConfig, load_scaling_sweep
from experiments.sweep.config import SweepConfig, load_sweep
from experiments.sweep.points import run_order
from experiments.sweep.probe_samples import ProbeSampler
from experiments.sweep.cluster_pool import ClusterPool
from experiments.sweep.run import run_sweep
from pipeline.cluster import embedded
from pipeline.config.run_config import RunConfig
from pipeline.prediction import predict_memory
from pipeline.placement.memory_fit import planned
from pipeline.config.schema import ConfigError, load_yaml
from pipeline.probe.machine import cpu_model, machine_identity
from pipeline.records.step_breakdown import COMPONENTS
from storage.labelled import write_dataset
from tasks.memory import current_rss
from tests.helpers import cut_probe_to_one_round, run_main
from tests.forked_servers import ForkedCluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def no_cluster_probes(monkeypatch, tmp_path):
    """The performance model may measure ("probe") a cluster before predicting; that
    costs more than these tiny points, so tests let it use only in-process probes
    (reference points), kept in a cache of their own. Subprocesses inherit this."""
    monkeypatch.setenv("CNN_PREDICT_PROBE", "never")
    monkeypatch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))


def write_sweep(tmp_path, dataset: str, axes: dict, repeats: int = 1, name: str = "tiny",
                base: dict | None = None, **extra) -> str:
    """A sweep file over the tiny network on the test dataset."""
    config = {
        "name": name,
        "base": {"strategy": "kernel", "placement": "even",
                 "network": {"conv": [{"kernels": 8}, {"kernels": 8}]},
                 "data": {"path": dataset, "train_samples": 512, "test_samples": 128},
                 "train": {"batch": 16, "eval_samples": 32, "checkpoint_every": 0},
                 "cluster": {"workers": 1},
                 **(base or {})},
        "measure": {"warmup_steps": 1, "steps": 2},
        "axes": axes, "repeats": repeats, **extra,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.sweep.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def error_lines(result) -> list[str]:
    text = result.stderr if hasattr(result, "stderr") else result
    return [line for line in text.splitlines() if line.strip()]


def close(a: xr.DataArray, b: xr.DataArray) -> bool:
    """Equal up to float error, matching dims by name (not by position)."""
    a, b = xr.broadcast(a, b)
    return bool(np.allclose(a.values, b.transpose(*a.dims).values, equal_nan=True))


def open_clean(path) -> xr.Dataset:
    """`xr.open_zarr` with every warning turned into an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return xr.open_zarr(path).load()


# End to end ---------------------------------------------------------------------------


def test_tiny_sweep_end_to_end(tmp_path, tiny_dataset_factory):
    dataset = tiny_dataset_factory("float32")
    config = write_sweep(tmp_path, dataset, {"strategy": ["single", "kernel"],
                                             "train.batch": [16]},
                         repeats=2, base={"cluster": {"workers": 2}})
    store = tmp_path / "out" / "tiny.zarr"
    result = run_cli(config, "--out", str(store))
    assert result.returncode == 0, result.stderr
    assert "dask dashboard" in result.stdout
    assert result.stdout.count("s/step") == 4  # one line per finished point
    assert "speedup" in result.stdout and "samples/s" in result.stdout  # the closing table
    assert "rep. spread" in result.stdout  # two repeats: how far they measured apart

    ds = open_clean(store)
    assert dict(ds.sizes) == {"strategy": 2, "batch": 1, "repeat": 2, "step": 3}
    assert list(ds.strategy.values) == ["single", "kernel"]
    assert list(ds.batch.values) == [16] and ds.batch.attrs["units"] == "samples"
    assert list(ds.repeat.values) == [0, 1]
    assert list(ds.warmup.values) == [True, False, False]
    for name in ("step_time", "step_time_p25", "step_time_p75", "throughput", "speedup",
                 "efficiency", "compute_time", "storage_time", "wait_time", "master_time",
                 "bytes_moved", "loss", "accuracy", "predicted_step_time",
                 "prediction_error", "status", "failure", "step_time_series", "memory_peak",
                 "memory_working", "client_memory_peak", "memory_per_worker",
                 "client_cpu_per_step", "task_steps"):
        assert name in ds, name
    for name, variable in ds.data_vars.items():
        assert variable.attrs.get("units") and variable.attrs.get("description"), name
    for key in ("config", "versions", "machine", "code_revision", "started", "finished"):
        assert ds.attrs.get(key), key
    assert json.loads(ds.attrs["machine"])["cores"] == os.cpu_count()
    assert json.loads(ds.attrs["machine"])["cpu"] == cpu_model()  # what error figures hold for
    assert "strategy" in ds.attrs["config"] and "torch" in json.loads(ds.attrs["versions"])
    # the workers' own machines, point by point (here the client's, one torch thread each)
    said = {"machine": machine_identity(), "torch_threads": 1}
    assert json.loads(str(ds.worker_machines.sel(strategy="kernel").values[0, 0])) == {
        "cpu-0": said, "cpu-1": said}
    assert trained_on(ds) == [f"- workers' machine: {machine_identity()} (cpu-0, cpu-1)"]

    assert (ds.status == DONE).all()
    assert (ds.step_time > 0).all() and ds.accuracy.notnull().all()
    assert (ds.memory_working > 0).all() and (ds.memory_peak > ds.memory_working).all()
    assert (ds.client_cpu_per_step > 0).all()
    assert (ds.task_steps >= 1).all()  # steps per Dask task (train.steps_per_task)
    assert close(ds.throughput, ds.batch / ds.step_time)
    baseline = ds.step_time.sel(strategy="single").median("repeat")
    assert close(ds.speedup, baseline / ds.step_time)
    # the baseline against itself: its repeats' times over their median (mean of 2)
    assert np.allclose((1 / ds.speedup.sel(strategy="single")).mean("repeat"), 1.0)
    assert list(ds.n_workers.sel(strategy="kernel").values.ravel()) == [2.0] * 2
    assert close(ds.efficiency.sel(strategy="kernel"), ds.speedup.sel(strategy="kernel") / 2)
    measured = ds.step_time_series.isel(step=~ds.warmup.values)
    assert close(measured.median("step"), ds.step_time)
    # no cluster probe here, so no prediction for single/kernel: NaN, never a stand-in
    assert ds.predicted_step_time.isnull().all() and ds.prediction_error.isnull().all()
    assert ds.predicted_compute.isnull().all()
    # each step's parts add up to it; over two measured steps their medians (means) too
    parts = sum(ds[f"critical_{part}"] for part in COMPONENTS)
    assert close(parts, ds.step_time) and (ds.critical_compute > 0).all()

    runs = [d for d in os.listdir(tmp_path / "out" / "tiny.runs")]
    assert len(runs) == 4
    assert all(not os.path.exists(tmp_path / "out" / "tiny.runs" / d / "checkpoints.zarr")
               for d in runs)

    # Everything done: nothing reruns. The same command's `main`, in this process (the
    # real process was met above; a second would add only its start-up).
    status, errors, again = run_main("sweep", [config, "--out", str(store)])
    assert status == 0, errors
    assert "4 done before, 0 to run" in again and "s/step" not in again
    assert (open_clean(store).run_id.values == ds.run_id.values).all()


def test_each_point_that_reuses_an_embedded_cluster_starts_on_fresh_workers(
        tmp_path, tiny_dataset_factory, monkeypatch):
    """What one point leaves in its workers (here 50 MB kept in a module) is gone
    when the next point gets the same cluster: new worker processes under the same
    names, set up again (one thread each), back to a fresh worker's memory. A
    restart whose workers do not come back in time is one line, and the point gets
    the cluster started again."""
    dataset = tiny_dataset_factory("float32")
    config = write_sweep(tmp_path, dataset, {"strategy": ["single", "kernel"]},
                         base={"cluster": {"workers": 2}})
    points = load_sweep(config, out=str(tmp_path / "fresh.zarr")).points
    assert points[0].cluster_key == points[1].cluster_key
    pool = ClusterPool(lambda line: None)
    try:
        client = pool.client_for(points[0])
        fresh = client.run(current_rss)
        client.run(lambda: setattr(sys, "_left_over", bytes(range(256)) * 200_000))
        left = client.run(current_rss)
        assert all(left[w] > fresh[w] + 40e6 for w in left)
        before = {info["name"] for info in client.scheduler_info()["workers"].values()}
        pids = set(client.run(os.getpid).values())

        assert pool.client_for(points[1]) is client  # the same cluster, its workers new
        after = client.run(current_rss)
        assert set(client.run(os.getpid).values()).isdisjoint(pids)
        names = {info["name"] for info in client.scheduler_info()["workers"].values()}
        assert names == before
        assert max(after.values()) < min(fresh.values()) + 20e6
        assert set(client.run(torch.get_num_threads).values()) == {1}  # set up again

        dask_log: list[logging.LogRecord] = []
        collect = logging.Handler()
        collect.emit = dask_log.append  # type: ignore[method-assign]
        logging.getLogger("distributed").addHandler(collect)  # what reaches its handlers
        monkeypatch.setattr(embedded, "restart_timeout", lambda workers: 0.001)
        lines: list[str] = []
        pool.echo = lines.append
        try:
            again = pool.client_for(points[1])
        finally:
            logging.getLogger("distributed").removeHandler(collect)
        assert again is not client and len(again.scheduler_info()["workers"]) == 2
        assert lines[0] == ("restarting the workers failed (they did not all come back in "
                            "time); starting the cluster again"), lines
        assert not [r for r in dask_log if r.levelno >= logging.ERROR], dask_log  # kept off
    finally:
        pool.close()


def test_a_sweep_with_repeats_probes_each_cluster_again_at_each_repeat(
        tmp_path, tiny_dataset_factory, monkeypatch):
    """`probe_samples: per_repeat`: repeat 0 is predicted from one probe; before repeat
    1's first point on a probe (the cluster's; this process's for `reference`) the
    sweep takes one more sample, says so, and repeat 1's points are predicted from the
    median over both (the cache keeps both samples). Which points get a sample is
    `test_samples_are_taken_before_the_first_point_of_each_later_repeat`'s. The probe
    is cut to one round: when samples are taken is under test, not their figures."""
    monkeypatch.setenv("CNN_PREDICT_PROBE", "auto")
    cut_probe_to_one_round(monkeypatch)
    dataset = tiny_dataset_factory("float32")
    base = {"train": {"batch": 16, "eval_samples": 0, "checkpoint_every": 0}}
    config = write_sweep(tmp_path, dataset, {"strategy": ["reference", "kernel"]},
                         repeats=2, base=base, probe_samples="per_repeat")
    store = tmp_path / "samples.zarr"
    status, errors, out = run_main("sweep", [config, "--out", str(store)])
    assert status == 0, errors

    def event(line: str) -> str:  # "kernel1" for a point's line, "sample ..." for a sample's
        if line.startswith("probe sample of "):
            return "sample " + line.split("probe sample of ")[1].split(" for repeat 1")[0]
        return line.split("strategy=")[1].split()[0] + line.split("repeat=")[1].split()[0]

    order = [event(line) for line in out.splitlines() if line.startswith("probe sample")
             or ("strategy=" in line and "s/step" in line)]
    assert order == ["reference0", "sample this process", "reference1", "kernel0",
                     "sample this cluster", "kernel1"], order
    assert out.count("median over 2 sample(s)") == 2
    samples: dict[str, int] = {}
    runs = store.parent / "samples.runs"
    for run in os.listdir(runs):
        with open(runs / run / "summary.json", encoding="utf-8") as handle:
            summary = json.load(handle)
        strategy, repeat = run.split("strategy=")[1][0], run.split("repeat=")[1]
        samples[strategy + repeat] = summary["prediction_probe_samples"]
    assert samples == {"r0": 1, "r1": 2, "k0": 1, "k1": 2}, samples
    cache = os.environ["CNN_PROBE_CACHE"]
    for kind in ("cluster", "master"):
        kept = [n for n in os.listdir(cache) if n.startswith(kind) and n.endswith(".samples.json")]
        assert len(kept) == 1, (kind, os.listdir(cache))
        with open(os.path.join(cache, kept[0]), encoding="utf-8") as handle:
            assert len(json.load(handle)) == 2


def test_samples_are_taken_before_the_first_point_of_each_later_repeat(tmp_path, monkeypatch):
    """Pure: in run order, a sample before the first point of repeat 1, 2, ... of each
    probe (a worker set with a network and batch; `reference`'s process by its threads
    too); none under `probe_samples: once` (the default) or a policy that may not
    measure."""
    config = write_sweep(tmp_path, "data.zarr", {"strategy": ["reference", "kernel", "data"],
                                                 "train.batch": [8, 16]}, repeats=3)
    points = load_sweep(config, out=str(tmp_path / "s.zarr")).points
    assert load_sweep(config, out=str(tmp_path / "s.zarr")).config.probe_samples == "once"

    def sampled(per_repeat: bool) -> list[str]:
        sampler = ProbeSampler(per_repeat, lambda line: None)
        return [f"{p.strategy.name}{p.config.train.batch}r{p.repeat}" for p in points
                if sampler.wanted(p)]

    monkeypatch.setenv("CNN_PREDICT_PROBE", "auto")
    assert sampled(True) == ["reference8r1", "reference16r1", "reference8r2", "reference16r2",
                             "kernel8r1", "kernel16r1", "kernel8r2", "kernel16r2"]
    assert sampled(False) == []
    monkeypatch.setenv("CNN_PREDICT_PROBE", "cached")
    assert sampled(True) == []


# Refusals and failures --------------------------------------------------------------


def test_concurrent_sweep_is_refused(tmp_path, tiny_dataset_factory):
    config = write_sweep(tmp_path, tiny_dataset_factory("float32"), {"train.batch": [8]})
    store = tmp_path / "busy.zarr"
    with SweepLock(str(store)):  # another sweep, alive: this test process
        result = run_cli(config, "--out", str(store))
    assert result.returncode == 3
    lines = error_lines(result)
    assert len(lines) == 1, result.stderr
    assert "another sweep" in lines[0] and f"pid {os.getpid()}" in lines[0]
    assert not store.exists()


def test_failed_points_are_recorded_and_the_sweep_goes_on(tmp_path, tiny_dataset_factory):
    dataset = tiny_dataset_factory("float32")
    # lr 1e8 diverges, in this process (reference) and on a cluster (kernel): known
    # only once the point runs.
    config = write_sweep(tmp_path, dataset, {"strategy": ["reference", "kernel"],
                                             "train.lr": [1.0e8, 0.05]})
    store = tmp_path / "fail.zarr"
    # the command's `main` in this process: failures are about points, not processes
    status, errors, out = run_main("sweep", [config, "--out", str(store)])
    assert status == 1, errors
    assert out.count("FAILED") == 2
    ds = open_clean(store)
    assert (ds.status.sel(lr=1e8) == FAILED).all()
    for strategy in ("reference", "kernel"):
        reason = str(ds.failure.sel(strategy=strategy, lr=1e8, repeat=0).values)
        assert reason.startswith("FloatingPointError") and "diverged" in reason
    # the kernel point after a failed one ran on a cluster started again
    assert (ds.status.sel(lr=0.05) == DONE).all()
    assert ds.step_time.sel(lr=1e8).isnull().all()
    done = ds.sel(strategy="reference", lr=0.05)
    assert done.step_time.notnull().all()
    # the model's prediction and its error, per point
    assert done.predicted_step_time.notnull().all()
    assert close(done.prediction_error, done.predicted_step_time / done.step_time - 1)
    assert (done.predicted_low <= done.predicted_step_time).all()  # the band around it
    assert (done.predicted_step_time <= done.predicted_high).all()
    assert "2 point(s) failed" in out


def test_points_their_run_would_refuse_stop_the_sweep_before_it_starts(tmp_path,
                                                                        tiny_dataset_factory):
    """A resource no worker of the embedded cluster offers: `pipeline.train --check`
    refuses such a run, so the sweep refuses the point before any point runs (it
    would fail at every such point, each after `cluster.wait_timeout`)."""
    config = write_sweep(tmp_path, tiny_dataset_factory("float32"),
                         {"strategy": ["reference", "kernel"], "train.lr": [1.0e8, 0.05]},
                         base={"cluster": {"workers": 1, "resource": "GPU",
                                           "wait_timeout": 0.5}})
    store = tmp_path / "refused.zarr"
    status, errors, out = run_main("sweep", [config, "--out", str(store)])
    assert status == 2 and len(errors) == 1, errors
    assert errors[0] == ("error: cluster.resource: no worker of the embedded cluster offers "
                         "'GPU' (they offer: CPU) (at point strategy=kernel lr=1e+08)")
    assert out == "" and not store.exists()


def test_a_batch_its_workers_memory_cannot_hold_is_recorded_not_run_and_the_rest_runs(
        tmp_path, tiny_dataset_factory):
    """`pipeline.train --check` refuses a batch no split fits into its workers' memory.
    A sweep with such a batch among its points stopped whole before any point ran
    (exit 2), so sweeping batch [32, 64, 128, 4096] measured nothing. Now the point
    is recorded as failed without running, its reason (predicted peak against the
    limit) in `failure` and `predicted_peak_memory`, one line says so, the other
    points run, and the exit status is a failed point's (1); a resume runs neither
    again, and the dry run lists it as not run."""
    dataset = tiny_dataset_factory("float32")
    # the limit lies halfway between the two batches' predicted peaks on this machine
    # (its measured bare-process baselines move them by tens of MB from one to another)
    sweep = load_sweep(write_sweep(tmp_path, dataset, {"train.batch": [16, 512]}))
    peaks = [planned(predict_memory(point.config).largest, point.config.cluster.memory_margin)
             for point in sweep.points]  # each with the margin placement keeps free
    assert peaks[0] < peaks[1], peaks
    limit = int((peaks[0] + peaks[1]) / 2 / 1e6)
    config = write_sweep(tmp_path, dataset, {"train.batch": [16, 512]},
                         base={"cluster": {"workers": [{"memory_limit": f"{limit}MB"}]}})
    store = tmp_path / "memory.zarr"
    status, errors, out = run_main("sweep", [config, "--out", str(store), "--dry-run"])
    assert status == 0 and not store.exists(), errors
    assert len(errors) == 1 and errors[0].startswith(
        "warning: 1 of 2 point(s) do not fit their workers' memory and will not run"), errors
    assert "batch=512 (first: memory: worker cpu-0 needs " in errors[0], errors
    rows = {line.split()[1]: line for line in out.splitlines()[2:]}
    assert rows["batch=512"].endswith("not run: beyond its workers' memory"), out
    assert rows["batch=16"].endswith("pending"), out

    status, errors, out = run_main("sweep", [config, "--out", str(store)])
    assert status == 1, errors
    assert errors[0].startswith("warning: 1 of 2 point(s) do not fit"), errors
    assert "1 to run, 1 not run (beyond their workers' memory)" in out
    assert out.count("s/step") == 1 and "1 point(s) not run: their predicted peak" in out
    ds = open_clean(store)
    assert list(ds.status.values[:, 0]) == [DONE, FAILED]
    failure = str(ds.failure.values[1, 0])
    assert failure.startswith("Infeasible: memory: worker cpu-0 needs "), failure
    assert "(predicted peak " in failure and "cluster.memory_margin's 15%), has " in failure
    assert planned(float(ds.predicted_peak_memory.values[1, 0]), 0.15) > limit * 1e6
    assert np.isnan(ds.step_time.values[1, 0]) and np.isfinite(ds.step_time.values[0, 0])
    run_id = str(ds.run_id.values[0, 0])

    status, errors, out = run_main("sweep", [config, "--out", str(store)])  # resume
    assert status == 1 and "1 done before, 0 to run, 1 not run" in out, (errors, out)
    again = open_clean(store)
    assert str(again.run_id.values[0, 0]) == run_id  # not run again
    assert list(again.status.values[:, 0]) == [DONE, FAILED]
    assert str(again.failure.values[1, 0]) == failure

    # a driver of `run_sweep` (no check before it) meets the refusal as the run meets
    # the workers: recorded the same way, not as a failure of the run ("MemoryRefused: ")
    alone = load_sweep(config, ["axes.train.batch=[512]"], out=str(tmp_path / "alone.zarr"))
    output = io.StringIO()
    assert run_sweep(alone, out=output, err=io.StringIO()) == 1
    ds = open_clean(tmp_path / "alone.zarr")
    assert str(ds.failure.values[0, 0]).startswith("Infeasible: memory: worker cpu-0 needs ")
    assert ds.predicted_peak_memory.values[0, 0] > limit * 1e6
    assert "0/1 (not run: memory)" in output.getvalue()
    assert "1 point(s) not run: their predicted peak" in output.getvalue()


def test_a_store_named_without_zarr_beside_one_with_it_is_refused(tmp_path,
                                                                   tiny_dataset_factory,
                                                                   monkeypatch):
    """results/x.zarr and results/x keep their runs in the same results/x.runs: a
    second sweep there replaced the first's point records (its --fresh deleted them
    all), and the two stores' locks did not keep them apart. Now the second is refused
    in one line, its dry run too, and the first's records are left as they were.
    `reference` points: in this process, no cluster to start for what is a store's."""
    monkeypatch.setenv("CNN_PREDICT_PROBE", "never")
    monkeypatch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))
    dataset = tiny_dataset_factory("float32")
    first = write_sweep(tmp_path, dataset, {"strategy": ["reference"]}, name="first")
    second = write_sweep(tmp_path, dataset, {"strategy": ["reference"]}, name="second",
                         base={"train": {"batch": 8}})
    store = tmp_path / "x.zarr"
    assert run_main("sweep", [first, "--out", str(store)])[0] == 0
    runs = sorted(os.listdir(tmp_path / "x.runs"))
    record = tmp_path / "x.runs" / runs[0] / "summary.json"
    before = record.read_bytes()
    for extra in (["--dry-run"], [], ["--fresh"]):
        status, errors, out = run_main("sweep", [second, "--out", str(tmp_path / "x"),
                                                 *extra])
        assert status == 2 and len(errors) == 1, errors
        assert errors[0] == (f"error: --out: {tmp_path / 'x'} would keep its runs in "
                             f"{tmp_path / 'x.runs'}, which holds those of the sweep store "
                             f"{store}; name the store apart from it (e.g. another stem)")
        assert out == "" and not (tmp_path / "x").exists()
    assert sorted(os.listdir(tmp_path / "x.runs")) == runs and record.read_bytes() == before
    shutil.rmtree(store)  # the first store gone (or moved, with its runs): no refusal
    assert run_main("sweep", [second, "--out", str(tmp_path / "x"), "--dry-run"])[0] == 0


@pytest.mark.parametrize("axes, zip_groups, expected", [
    ({"train.btch": [8, 16]}, [], ["train.btch", "unknown key", "axes.train.btch"]),
    ({"train.batch": []}, [], ["axes.train.batch", "at least one value"]),
    ({"train.batch": [8, "big"]}, [], ["train.batch", "expected an integer", "'big'"]),
    ({"train.batch": 16}, [], ["axes.train.batch", "list of values"]),
    ({"output": ["a", "b"]}, [], ["axes.output", "cannot be swept"]),
    ({"train.fresh": [True, False]}, [], ["axes.train.fresh", "cannot be swept"]),
    ({"prediction": ["never", "auto"]}, [], ["axes.prediction", "cannot be swept"]),
    ({}, [{"network.conv.0.kernels": [8, 12], "network.conv.1.kernels": [8]}],
     ["zip.0", "network.conv.1.kernels has 1"]),
    ({"zip": [{"fields": {"train.batch": [8, 16]}}]}, [],
     ["axes.zip: `zip:` is a key of the sweep file itself, beside `axes:`"]),
    ({"strategy": ["kernel", "magic"]}, [], ["strategy", "'magic'"]),
    ({"train.batch": {"dim": "strategy", "values": [8, 16]}, "strategy": ["single"]}, [],
     ["axes.strategy: its dim name 'strategy' is taken by another axis", "`dim:`"]),
    ({"train.lr": {"dim": "batch", "values": [0.1]}}, [{"dim": "batch", "fields": {
        "train.batch": [8]}}], ["zip.0.dim: the name 'batch' is already taken"]),
])
def test_bad_sweep_configs_exit_2_with_one_line(tmp_path, capsys, tiny_dataset_factory, axes,
                                                zip_groups, expected):
    """In this process; the command run as a process, refusing in one line, is
    test_concurrent_sweep_is_refused's."""
    config = write_sweep(tmp_path, "unused.zarr", axes, zip=zip_groups)
    assert sweep_cli.main([config, "--out", str(tmp_path / "bad.zarr")]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("error: ")
    for text in expected:
        assert text in lines[0], lines[0]
    assert not (tmp_path / "bad.zarr").exists()


def test_the_sweep_file_keys_are_the_sweep_configs_own_fields():
    """`SWEEP_FILE_KEYS` (an `axes:` entry named like one gets its own message) are the
    measured and scaling sweep files' fields that a run's config and a scaling point
    do not have: a field added to either sweep config is added there too."""
    own = ({f.name for f in dataclasses.fields(SweepConfig)}
           | {f.name for f in dataclasses.fields(ScalingSweepConfig)})
    shared = ({f.name for f in dataclasses.fields(RunConfig)}
              | {f.name for f in dataclasses.fields(ScalingPoint)})
    assert set(SWEEP_FILE_KEYS) == own - shared


def test_a_dry_run_of_a_store_another_sweep_holds_is_refused_as_the_run_is(tmp_path, capsys):
    config = write_sweep(tmp_path, "unused.zarr", {"train.batch": [8]})
    store = str(tmp_path / "held.zarr")
    with SweepLock(store):
        for dry in ([], ["--dry-run"]):
            assert sweep_cli.main([config, "--out", store, *dry]) == 3
            lines = error_lines(capsys.readouterr().err)
            assert len(lines) == 1 and f"{store} is in use by another sweep (pid " in lines[0]


def test_a_preset_on_the_sweeps_command_line_replaces_the_base_network(tmp_path):
    """As `python -m pipeline.train cfg network.preset=...` does: the base's own layers
    and hidden widths give way (they were kept, and the sweep refused "give a preset
    or your own layers, not both"); a layer set after the preset is refused."""
    own = {"network": {"layers": [{"conv": 4}, {"pool": "max"}], "hidden": [8]}}
    config = write_sweep(tmp_path, "unused.zarr", {"network.width": [0.25]}, base=own)
    out = str(tmp_path / "p.zarr")
    sweep = load_sweep(config, ["network.preset=resnet20"], out=out)
    assert sweep.base["network"] == {"preset": "resnet20"}
    assert sweep.points[0].config.network.preset == "resnet20"
    with pytest.raises(ConfigError, match="network.layers.0.conv: network.preset resnet20 "
                                          "gives the layers"):
        load_sweep(config, ["network.preset=resnet20", "network.layers.0.conv=3"], out=out)


def test_a_base_file_that_is_not_there_is_named_by_its_field(tmp_path, capsys):
    config = tmp_path / "s.yaml"
    config.write_text("name: s\nbase: configs/nope.yaml\naxes: {strategy: [kernel]}\n")
    assert sweep_cli.main([str(config), "--dry-run"]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: base: no run config configs/nope.yaml beside the sweep file "
        f"({tmp_path / 'configs' / 'nope.yaml'}) or in the current folder"]


def test_base_on_the_command_line_replaces_the_sweeps_base(tmp_path, capsys):
    """`base=FILE` swaps the run config a sweep starts from (it was taken for a field
    of the base and refused as "base: unknown key"); a base that is neither a run
    config nor a path to one is one line saying so, on the command line as in the
    file, for measured and scaling sweeps."""
    config = write_sweep(tmp_path, "unused.zarr", {"strategy": ["kernel"]})
    other = tmp_path / "other.yaml"
    other.write_text("train: {batch: 24}\nnetwork: {conv: [{kernels: 4}]}\n")
    sweep = load_sweep(config, [f"base={other}"], out=str(tmp_path / "b.zarr"))
    assert sweep.base["train"]["batch"] == 24
    assert sweep.base["network"]["conv"] == [{"kernels": 4}]
    assert sweep.points[0].config.train.batch == 24
    scaling = os.path.join(ROOT, "experiments", "configs", "scaling.yaml")
    expected = "error: base: expected a run config (a mapping) or a path to one, got 3"
    for argv in ([config, "base=3", "--dry-run"], [scaling, "base=3", "--dry-run"]):
        assert sweep_cli.main(argv) == 2
        assert error_lines(capsys.readouterr().err) == [expected]
    written = tmp_path / "three.yaml"
    written.write_text("name: three\nbase: 3\naxes: {strategy: [kernel]}\n")
    assert sweep_cli.main([str(written), "--dry-run"]) == 2
    assert error_lines(capsys.readouterr().err) == [expected]
    # a sweep file named as the base (it was 'axes: unknown key'), measured or scaling
    quick = os.path.join(ROOT, "experiments", "configs", "quick.yaml")
    for argv in ([config, f"base={quick}", "--dry-run"], [scaling, f"base={quick}", "--dry-run"]):
        assert sweep_cli.main(argv) == 2
        assert error_lines(capsys.readouterr().err) == [
            f"error: base: {quick} is a sweep config (it has axes and base), not a base: "
            "name the base it uses, or write its fields here"]


def test_store_of_another_sweep_is_not_overwritten(tmp_path, capsys):
    first = write_sweep(tmp_path, "unused.zarr", {"train.batch": [8, 16]}, name="one")
    store = str(tmp_path / "shared.zarr")
    sweep = load_sweep(first, out=store)
    ResultStore(store).create(build_template(sweep, {"fingerprint": sweep.fingerprint,
                                                     "config": sweep.text}))
    second = write_sweep(tmp_path, "unused.zarr", {"train.batch": [8, 32]}, name="two")
    assert sweep_cli.main([second, "--out", store]) == 2
    message = capsys.readouterr().err
    assert "holds a different sweep" in message and "--fresh" in message
    assert list(xr.open_zarr(store).batch.values) == [8, 16]
    other = tmp_path / "not_a_sweep.zarr"
    write_dataset(xr.Dataset({"a": ("x", [1.0])}), str(other))
    assert sweep_cli.main([second, "--out", str(other), "--fresh"]) == 2
    assert "not a sweep results store" in capsys.readouterr().err
    assert float(xr.open_zarr(other).a[0]) == 1.0  # --fresh replaces only sweep stores


def test_a_path_that_is_no_sweep_store_is_not_offered_to_fresh(tmp_path, capsys):
    """A run's output directory (no Zarr store) or another Zarr store given as --out:
    the line says to choose another --out; it offered --fresh, which replaces only
    sweep stores and so refused them too. Nothing there changes."""
    config = write_sweep(tmp_path, "unused.zarr", {"train.batch": [8]})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text("{}")
    other = tmp_path / "other.zarr"
    write_dataset(xr.Dataset({"a": ("x", [1.0])}), str(other))
    for path in (run_dir, other):
        for fresh in ([], ["--fresh"]):
            assert sweep_cli.main([config, "--out", str(path), "--dry-run", *fresh]) == 2
            lines = error_lines(capsys.readouterr().err)
            assert len(lines) == 1 and "not a sweep results store" in lines[0], lines
            assert "another --out" in lines[0] and "--fresh to" not in lines[0], lines
    assert os.listdir(run_dir) == ["summary.json"] and float(xr.open_zarr(other).a[0]) == 1.0


# The config, without running --------------------------------------------------------


def test_dry_run_lists_points_in_run_order(tmp_path, capsys):
    config = write_sweep(tmp_path, "unused.zarr", {
        "strategy": ["kernel", "reference"],
        "cluster.workers": [2, [{"speed": 1.0}, {"speed": 0.5}], 2 * [{"speed": 1.0}]]})
    assert sweep_cli.main([config, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "6 points" in out
    lines = [line for line in out.splitlines() if line[:1].isdigit()]
    assert "strategy=reference" in lines[0] and "strategy=reference" in lines[2]
    assert "workers=1+0.5" in out and "workers=1+1" in out
    assert not os.path.exists(os.path.join("results", "tiny.zarr"))


def test_a_sweep_of_zoo_networks_asks_the_model_at_every_point(tmp_path, capsys,
                                                                monkeypatch):
    """resnet20 and vgg11 points under `CNN_PREDICT_PROBE=auto`: the dry run asks the
    model about every point (probing each cluster), and `auto` beside a zoo network is
    a point like any other, not skipped."""
    probed: list[str] = []  # the probes are stubbed: count them
    for name in ("cached_master_probe", "probe_for_config"):
        monkeypatch.setattr(f"pipeline.prediction.{name}",
                            lambda *_, name=name, **__: probed.append(name))
    monkeypatch.setenv("CNN_PREDICT_PROBE", "auto")
    config = write_sweep(tmp_path, str(tmp_path / "unused.zarr"), {
        "strategy": ["kernel", "reference"], "network.preset": ["resnet20", "vgg11"]},
        base={"network": {"width": 0.125}})
    assert sweep_cli.main([config, "--dry-run"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line[:1].isdigit()]
    assert len(lines) == 4
    assert sorted(set(probed)) == ["cached_master_probe", "probe_for_config"]
    mixed = write_sweep(tmp_path, str(tmp_path / "unused.zarr"), {
        "strategy": ["kernel", "auto"], "network.preset": ["marques", "resnet20"]},
        name="mixed")
    assert [p.skip for p in load_sweep(mixed).points] == [""] * 4


def test_axes_zip_labels_and_cluster_blocks(tmp_path):
    config = write_sweep(tmp_path, "unused.zarr", {
        "strategy": ["single", "kernel", "reference"],
        "cluster.workers": [1, [{"speed": 1.0}, {"speed": 0.5, "threads": 2}]]},
        zip=[{"dim": "width", "fields": {"network.conv.0.kernels": [8, 12],
                                         "network.conv.1.kernels": [8, 16]}}],
        repeats=2)
    sweep = load_sweep(config, ["train.lr=0.1", "repeats=2"])
    assert sweep.dims == ["strategy", "workers", "width"]
    assert sweep.shape == (3, 2, 2, 2)
    assert sweep.axes[1].labels == ("1", "1+0.5(2t)")
    assert sweep.axes[2].labels == ("8/8", "12/16")
    assert all(p.config.train.lr == 0.1 and p.config.train.steps == 3 for p in sweep.points)
    # reference first, then one block per worker set, each block's repeats in turn
    keys = [p.cluster_key for p in sweep.points]
    assert keys[:8] == [None] * 8
    blocks = [k for i, k in enumerate(keys) if i == 0 or k != keys[i - 1]]
    assert len(blocks) == 3 and len(set(blocks)) == 3
    assert [p.repeat for p in sweep.points[8:16]] == [0] * 4 + [1] * 4
    assert run_order(list(reversed(sweep.points))) == sweep.points
    point = next(p for p in sweep.points if p.labels == {"strategy": "kernel",
                                                         "workers": "1+0.5(2t)",
                                                         "width": "12/16"})
    assert [c.kernels for c in point.config.network.conv] == [12, 16]
    assert point.config.output.startswith(os.path.join("results", "tiny.runs"))
    assert value_label("cluster.workers", [{"speed": 1.0, "resources": {"GPU": 1}}]) == "GPU:1"


def test_a_name_given_with_dim_is_kept_and_the_field_named_axis_makes_way(tmp_path):
    """A `dim:` naming another axis's field (written before or after it) takes the
    name; the other axis falls back on its whole field, as a clash between two
    fields' last parts does."""
    for order in ("named first", "named last"):
        axes = {"cluster.workers": [1, 2],
                "train.batch": {"dim": "workers", "values": [8, 16]}}
        if order == "named first":
            axes = dict(reversed(list(axes.items())))
        sweep = load_sweep(write_sweep(tmp_path, "unused.zarr", axes))
        by_field = {axis.fields: axis.dim for axis in sweep.axes}
        assert by_field == {("cluster.workers",): "cluster_workers",
                            ("train.batch",): "workers"}, order
        point = next(p for p in sweep.points
                     if p.labels == {"cluster_workers": "2", "workers": "16"})
        assert point.config.train.batch == 16, order


def test_axes_sharing_a_last_part_are_named_by_their_whole_fields_in_any_order():
    """Two unnamed axes whose fields end alike take their whole fields, both, so that
    writing them in the other order names the same dims (the first took the short
    name, and a store written one way was another sweep's the other way)."""
    axes = {"hardware.cpu.flops": [1e12], "hardware.gpu.flops": [1e14, 2e14],
            "devices": [1, 2]}
    for order in (axes, dict(reversed(list(axes.items())))):
        named = {axis.fields[0]: axis.dim
                 for axis in build_axes(SimpleNamespace(axes=order, zip=[]))}
        assert named == {"hardware.cpu.flops": "hardware_cpu_flops",
                         "hardware.gpu.flops": "hardware_gpu_flops", "devices": "devices"}


def test_a_scheduler_that_does_not_answer_stops_the_sweep_before_any_point(
        tmp_path, tiny_dataset_factory):
    """`--scheduler` at an address where nothing listens: the dry run listed every
    point (exit 0), and the sweep ran and stored its `reference` points, which need no
    cluster, under that scheduler's session before the first point that did failed.
    Now both say so first, in one line, and write nothing."""
    config = write_sweep(tmp_path, tiny_dataset_factory("float32"),
                         {"strategy": ["reference", "kernel"]})
    store = tmp_path / "unanswered.zarr"
    for flags in (["--dry-run"], []):
        status, errors, out = run_main("sweep", [config, "--out", str(store),
                                                 "--scheduler", "tcp://127.0.0.1:1", *flags])
        assert status == 1 and errors == [
            "error: cannot reach the Dask scheduler at tcp://127.0.0.1:1 (connection "
            "refused: nothing listens there); is `dask scheduler` running there?"], errors
        assert out == "" and not store.exists()


def test_a_prediction_in_the_base_is_said_to_be_unused(tmp_path, tiny_dataset_factory,
                                                       monkeypatch):
    """The points' runs take the sweep's probe policy: `prediction=never` on the
    sweep's command line was ignored unsaid. The default (a base written from a run's
    config.yaml holds it) is not worth a line."""
    monkeypatch.setenv("CNN_PREDICT_PROBE", "cached")
    config = write_sweep(tmp_path, tiny_dataset_factory("float32"), {"strategy": ["kernel"]})
    store = str(tmp_path / "said.zarr")
    status, errors, _out = run_main("sweep", [config, "--out", store, "--dry-run",
                                              "prediction=never"])
    assert status == 0 and errors[0] == (
        "warning: base.prediction: never is not used: a sweep's points take its probe "
        "policy, $CNN_PREDICT_PROBE (now cached; docs/sweeps.md)"), errors
    status, errors, _out = run_main("sweep", [config, "--out", store, "--dry-run",
                                              "prediction=cached"])
    assert status == 0 and not [e for e in errors if "prediction" in e], errors


def test_an_axis_of_integers_past_int64_keeps_them_whole():
    """A seed axis of 2^64 - 1 (train.seed's largest) became a float coordinate and
    the label "1.84467e+19"; 10^20 devices overflowed the int64 coordinate."""
    seeds = {"train.seed": [2**64 - 1, 1]}
    [axis] = build_axes(SimpleNamespace(axes=seeds, zip=[]))
    assert list(axis.coordinate()) == ["18446744073709551615", "1"]
    assert axis.coordinate().dtype == object and not axis.plain  # its JSON values beside
    [plain] = build_axes(SimpleNamespace(axes={"train.seed": [2**63 - 1, 1]}, zip=[]))
    assert plain.coordinate().dtype == np.int64 and plain.coordinate()[0] == 2**63 - 1


def test_external_scheduler_sweeps_worker_counts_with_use_workers(tmp_path):
    config = write_sweep(tmp_path, "unused.zarr", {"cluster.workers": [1, 3]})
    sweep = load_sweep(config, scheduler="tcp://10.0.0.1:8786")
    assert [p.config.cluster.use_workers for p in sweep.points] == [1, 3]
    assert {p.cluster_key for p in sweep.points} == {"external"}
    emulated = write_sweep(tmp_path, "unused.zarr",
                           {"cluster.workers": [[{"speed": 1.0}, {"speed": 0.5}]]})
    with pytest.raises(ConfigError, match="cluster.use_workers"):
        load_sweep(emulated, scheduler="tcp://10.0.0.1:8786")


def test_contention_warning(tmp_path, monkeypatch):
    config = write_sweep(tmp_path, "unused.zarr", {"cluster.workers": [2, 3]})
    sweep = load_sweep(config)
    monkeypatch.setattr(sweep_cli.os, "cpu_count", lambda: 2)
    warning = sweep_cli.contention_warning(sweep)
    assert warning is not None and len(warning.splitlines()) == 1
    assert "1 of 2 points" in warning and "3 threads" in warning
    monkeypatch.setattr(sweep_cli.os, "cpu_count", lambda: 8)
    assert sweep_cli.contention_warning(sweep) is None


def test_no_contention_warning_for_batch_jobs(tmp_path, monkeypatch):
    """Batch jobs (`cluster.jobqueue`) run where the queue puts them, not on this
    machine's cores: a sweep of 3 jobs of 2 cores on a 2-core login node is no
    contention (the dry run counts 3 workers, `cluster.workers` being the jobs)."""
    config = write_sweep(tmp_path, "unused.zarr", {"cluster.workers": [2, 3]},
                         base={"cluster": {"threads": 2, "jobqueue": {"memory": "1GB"}}})
    sweep = load_sweep(config)
    assert [p.config.cluster.jobqueue.jobs for p in sweep.points] == [2, 3]
    monkeypatch.setattr(sweep_cli.os, "cpu_count", lambda: 2)
    assert sweep_cli.contention_warning(sweep) is None


def test_speedup_against_baseline_median_and_capacity():
    # strategy axis [single, kernel], one other axis of 2, 2 repeats
    step_time = np.array([[[2.0, 4.0], [1.0, 1.0]], [[1.0, 1.5], [0.5, np.nan]]])
    capacity = np.array([[[1.0, 1.0], [1.0, 1.0]], [[2.0, 2.0], [1.5, np.nan]]])
    speedup, efficiency = compute_speedup(step_time, capacity, 0, 0, True)
    assert np.allclose(speedup[1, 0], [3.0, 2.0])  # median(2, 4) = 3
    assert np.allclose(speedup[1, 1, 0], 2.0) and np.isnan(speedup[1, 1, 1])
    assert np.allclose(efficiency[1, 0], [1.5, 1.0])
    assert np.allclose(efficiency[1, 1, 0], 2.0 / 1.5)
    nothing, _ = compute_speedup(step_time, capacity, None, None, False)
    assert np.isnan(nothing).all()


def test_speedup_counts_the_samples_where_the_batch_moves_with_the_workers():
    """Weak scaling: batch 8 on 1 worker in 1.0 s, batch 16 on 2 workers in 1.0 s is
    twice the samples a second (speedup 2, efficiency 1), not a speedup of 1."""
    step_time = np.array([[[1.0], [1.0]]])  # strategy [kernel] x workers [1, 2]
    capacity = np.array([[[1.0], [2.0]]])
    batch = np.array([[[8.0], [16.0]]])
    speedup, efficiency = compute_speedup(step_time, capacity, None, None, True, 1, 0, batch)
    assert np.allclose(speedup[0, :, 0], [1.0, 2.0])
    assert np.allclose(efficiency[0, :, 0], [1.0, 1.0])


def test_a_workers_axis_zipped_with_the_work_itself_is_said(tmp_path, tiny_dataset_factory):
    """Kernels zipped with the workers make speedup divide step times of different
    networks: the dry run (and the run) says so in one line; a batch or the cluster's
    own fields moving with the workers (weak scaling) are the same work, and nothing
    is said."""
    dataset = tiny_dataset_factory("float32")
    grown = write_sweep(tmp_path, dataset, {}, name="grown",
                        zip=[{"dim": "scaled", "fields": {
                            "cluster.workers": [1, 2], "network.conv.0.kernels": [8, 16]}}])
    status, errors, _ = run_main("sweep", [grown, "--out", str(tmp_path / "g.zarr"),
                                           "--dry-run"])
    assert status == 0
    said = [line for line in errors if "speedup and efficiency" in line]
    assert said == ["warning: network.conv.0.kernels change(s) with cluster.workers (zip.0): "
                    "speedup and efficiency compare steps of different work, not the same "
                    "work on more workers"]
    weak = write_sweep(tmp_path, dataset, {}, name="weak",
                       zip=[{"fields": {"cluster.workers": [1, 2], "train.batch": [8, 16],
                                        "cluster.threads": [1, 1]}}])
    assert speedup_caveat(load_sweep(weak)) is None
    assert speedup_caveat(load_sweep(write_sweep(tmp_path, dataset, {"cluster.workers": [1, 2]},
                                                 name="plain"))) is None


def test_the_grid_fits_each_strategy(tmp_path, tiny_dataset_factory):
    """Along a workers axis, `reference` takes that many threads and `single` is run
    once, at the fewest workers; the other strategies use the workers."""
    config = write_sweep(tmp_path, tiny_dataset_factory("float32"),
                         {"strategy": ["reference", "single", "kernel"],
                          "cluster.workers": [1, 2, [{"speed": 1.0}, {"speed": 0.5}]]})
    sweep = load_sweep(config, out=str(tmp_path / "grid.zarr"))
    points = {(p.labels["strategy"], p.labels["workers"]): p for p in sweep.points}
    assert [points[("reference", w)].config.reference.threads for w in ("1", "2", "1+0.5")] \
        == [1, 2, 2]
    assert points[("single", "1")].skip == ""
    assert points[("single", "2")].skip.startswith("single runs on one worker: measured at "
                                                   "workers=1")
    assert points[("single", "1+0.5")].skip and not points[("kernel", "2")].skip
    explicit = write_sweep(tmp_path, tiny_dataset_factory("float32"),
                           {"strategy": ["reference"], "cluster.workers": [1, 2],
                            "reference.threads": [1]}, name="explicit")
    assert {p.config.reference.threads for p in load_sweep(explicit).points} == {1}


def test_speedup_baseline_is_the_baseline_strategy_on_the_fewest_workers():
    # axes: strategy [reference, kernel] x workers [1, 2]; one repeat
    step_time = np.array([[[4.0], [2.2]], [[3.0], [2.0]]])
    capacity = np.array([[[1.0], [2.0]], [[1.0], [2.0]]])
    speedup, efficiency = compute_speedup(step_time, capacity, 0, 0, True, 1, 0)
    assert np.allclose(speedup[:, :, 0], [[1.0, 4 / 2.2], [4 / 3.0, 2.0]])
    assert np.allclose(efficiency[1, 1, 0], 1.0)  # 2x on 2 workers


def test_points_that_would_repeat_another_are_recorded_not_run(tmp_path, tiny_dataset_factory):
    config = write_sweep(tmp_path, tiny_dataset_factory("float32"),
                         {"strategy": ["reference", "single"], "cluster.workers": [1, 2]},
                         speedup_baseline="reference")
    store = str(tmp_path / "skip.zarr")
    sweep = load_sweep(config, out=store)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CNN_PREDICT_PROBE", "never")
        listed = io.StringIO()  # before any store: the dry run says so too (it said nothing)
        sweep_cli.dry_run(sweep, listed)
        rows = [line for line in listed.getvalue().splitlines() if line[:1].isdigit()]
        assert len(rows) == 4, listed.getvalue()
        for row in rows:
            skipped = "strategy=single" in row and "workers=2" in row
            assert row.endswith("not applicable" if skipped else "pending"), row
        output = io.StringIO()
        assert run_sweep(sweep, out=output, err=io.StringIO()) == 0
    assert "3 to run, 1 not applicable" in output.getvalue()
    ds = open_clean(store)
    assert json.loads(ds.attrs["sessions"])[0]["command"]  # each session's, for the report
    assert (ds.status.sel(strategy="single", workers=2) == SKIPPED).all()
    assert "measured at workers=1" in str(ds.failure.sel(strategy="single", workers=2).values.ravel()[0])
    assert ds.step_time.sel(strategy="single", workers=2).isnull().all()
    assert (ds.capacity.sel(strategy="reference", workers=2) == 2.0).all()  # two threads
    assert np.allclose(ds.speedup.sel(strategy="reference", workers=1), 1.0)
    table = summary_table(ds)
    assert len(table) == 3 and not ((table.strategy == "single") & (table.workers == "2")).any()
    # grown by a repeat (--extend): its new single@2 is not applicable either, not pending
    grown, listed = load_sweep(config, ["repeats=2"], out=store), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CNN_PREDICT_PROBE", "never")
        sweep_cli.dry_run(grown, listed, extend=True)
    rows = [line for line in listed.getvalue().splitlines() if line[:1].isdigit()]
    assert len(rows) == 8, listed.getvalue()
    for row in rows:
        skipped = "strategy=single" in row and "workers=2" in row
        new = "repeat=1" in row
        assert row.endswith("not applicable" if skipped else "pending" if new else "done"), row


def test_the_table_puts_the_computes_error_beside_the_steps():
    """Where the two agree, the miss is the arithmetic's speed, not the model's
    exchange or overheads; stores without it keep the old table."""
    table = pd.DataFrame([
        {"strategy": "data", "runs": "1/1", "step_time": 0.05, "predicted_step_time": 0.07,
         "prediction_error": 0.43, "compute_error": 0.5, "failure": ""},
        {"strategy": "kernel", "runs": "1/1", "step_time": 0.07, "predicted_step_time": 0.07,
         "prediction_error": 0.0, "compute_error": float("nan"), "failure": ""}])
    lines = format_table(table).splitlines()
    assert lines[0].split()[-4:] == ["pred.", "err", "compute", "err"]
    assert lines[1].split()[-2:] == ["+43%", "+50%"]
    assert lines[2].split()[-2:] == ["+0%", "-"]
    assert "compute err" not in format_table(table.drop(columns="compute_error"))


def test_the_table_says_how_far_repeats_measured_apart_beside_the_errors():
    """An error of 18 % beside repeats 25 % apart is the machine's noise as much as the
    model's: the spread is the last column wherever a point has two done repeats."""
    assert repeat_spread_of(np.array([1.0, 1.25, np.nan])) == pytest.approx(0.25 / 1.125)
    assert np.isnan(repeat_spread_of(np.array([1.0, np.nan])))
    table = pd.DataFrame([
        {"strategy": "data", "runs": "3/3", "step_time": 0.05, "predicted_step_time": 0.059,
         "prediction_error": 0.18, "compute_error": 0.1, "repeat_spread": 0.25,
         "failure": ""},
        {"strategy": "kernel", "runs": "1/3", "step_time": 0.07, "predicted_step_time": 0.07,
         "prediction_error": 0.0, "compute_error": 0.0, "repeat_spread": float("nan"),
         "failure": ""}])
    lines = format_table(table).splitlines()
    assert lines[0].split()[-2:] == ["rep.", "spread"]
    assert lines[1].split()[-3:] == ["+18%", "+10%", "25%"]
    assert lines[2].split()[-1] == "-"
    unpredicted = table.assign(predicted_step_time=float("nan"))
    assert format_table(unpredicted).splitlines()[0].split()[-2:] == ["rep.", "spread"]
    assert "spread" not in format_table(table.assign(repeat_spread=float("nan")))


def test_rates_over_repeats_agree_with_the_median_step():
    """Two repeats of the baseline, 0.048 and 0.029 s: each repeat's speedup is their
    median over its own step (0.80, 1.34); the table's is the baseline's median over
    the point's median step, 1.00, not the median of those two (1.07), and so are its
    samples/s and efficiency."""
    steps = np.array([[0.048, 0.029], [0.030, 0.031]])
    base = np.median(steps[0])
    ds = xr.Dataset({"status": (("strategy", "repeat"), np.full((2, 2), DONE)),
                     "failure": (("strategy", "repeat"), np.full((2, 2), "")),
                     "step_time": (("strategy", "repeat"), steps),
                     "throughput": (("strategy", "repeat"), 16 / steps),
                     "speedup": (("strategy", "repeat"), base / steps),
                     "efficiency": (("strategy", "repeat"), base / steps / 2)},
                    coords={"strategy": ["single", "kernel"]})
    table = summary_table(ds).set_index("strategy")
    assert table.loc["single", "speedup"] == pytest.approx(1.0)
    assert table.loc["single", "throughput"] == pytest.approx(16 / base)
    assert table.loc["kernel", "speedup"] == pytest.approx(base / 0.0305)
    assert table.loc["kernel", "efficiency"] == pytest.approx(base / 0.0305 / 2)


SHIPPED = os.path.join(ROOT, "experiments", "configs")


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(SHIPPED) if f.endswith(".yaml")))
def test_every_shipped_sweep_config_expands_into_valid_points(name, tmp_path):
    """The configs the README and docs/benchmarks.md give commands for stay valid as
    the run config's fields change (every point is checked as a run config)."""
    path = os.path.join(SHIPPED, name)
    if load_yaml(path).get("mode") == "scaling":
        assert load_scaling_sweep(path).points
    else:
        assert load_sweep(path, out=str(tmp_path / "results.zarr")).points


def test_a_store_of_this_sweep_with_its_axes_in_another_order_is_refused(
        tmp_path, tiny_dataset_factory):
    """The fingerprint does not see the order of the axes: written in another order,
    the same sweep was taken for the store's, and each point's cell was another's
    (the dry run called `strategy=kernel batch=8` what the store holds of single at
    batch 16; a resume wrote into those cells). Now it is refused in one line, dry run
    and run, with nothing written; the axes in the store's order, or --fresh, go on."""
    from experiments.sweep.run import _prepare_store
    dataset = tiny_dataset_factory("float32")
    axes = {"strategy": ["single", "kernel"], "train.batch": [8, 16]}
    config = write_sweep(tmp_path, dataset, axes)
    store = tmp_path / "tiny.zarr"
    _prepare_store(load_sweep(config, out=str(store)), ResultStore(str(store)), False, [])
    before = sorted(os.listdir(store))
    write_sweep(tmp_path, dataset, dict(reversed(list(axes.items()))))
    for extra in (["--dry-run"], []):
        status, errors, out = run_main("sweep", [config, "--out", str(store), *extra])
        assert status == 2 and len(errors) == 1 and out == "", (errors, out)
        assert errors[0] == (f"error: {store} holds this sweep with its axes in another order "
                             "(strategy, batch there, batch, strategy here): each point would "
                             "land in another's cell; write them in the store's order, or "
                             "pass --fresh to start over or --out for a new store")
    assert sorted(os.listdir(store)) == before
    status, errors, out = run_main("sweep", [config, "--out", str(store), "--dry-run",
                                             "--fresh"])
    assert status == 0, errors
    write_sweep(tmp_path, dataset, axes)
    assert run_main("sweep", [config, "--out", str(store), "--dry-run"])[0] == 0


def test_a_scheduler_connected_to_again_after_a_failed_point_is_described_once(tmp_path):
    """After a failed point the pool drops its client and connects again for the next
    point: on a scheduler you started, the line `scheduler ADDR; dask dashboard: ...`
    was said again after every failed point; it is said once."""
    cluster = ForkedCluster(tmp_path)
    try:
        address = cluster.start_scheduler()
        cluster.start_worker("w0")
        config = write_sweep(tmp_path, "unused.zarr", {"strategy": ["single", "kernel"]})
        points = load_sweep(config, scheduler=address, out=str(tmp_path / "x.zarr")).points
        lines: list[str] = []
        pool = ClusterPool(lines.append)
        try:
            pool.client_for(points[0]).wait_for_workers(1, timeout=60)
            pool.discard()  # as after a failed point
            pool.client_for(points[1])
        finally:
            pool.close()
    finally:
        cluster.stop()
    assert [line for line in lines if "dask dashboard" in line] == [lines[0]], lines
    assert lines[0].startswith(f"scheduler {address}; dask dashboard: ")


def test_points_on_other_tags_of_a_scheduler_are_set_up_for_their_own(tmp_path):
    """A sweep over `cluster.resource` on a scheduler you started: a run's setup sets
    up only the workers offering its tags (tasks/setup_gate.py), so the point on
    `OTHER` gets a client of its own, set up for it; reusing the `CPU` point's, its
    worker was never set up ("worker ... was not set up")."""
    from tests.test_cli import CliCluster

    cluster = CliCluster(tmp_path, dashboards=False)
    try:
        address = cluster.start_scheduler()
        cluster.start_worker("--name", "cpu", "--no-nanny")
        cluster.start_worker("--name", "other", "--no-nanny", "--resources", "OTHER=1")
        config = write_sweep(tmp_path, "unused.zarr", {"cluster.resource": ["CPU", "OTHER"]})
        points = load_sweep(config, scheduler=address, out=str(tmp_path / "x.zarr")).points
        pool = ClusterPool(lambda line: None)
        try:
            pool.client_for(points[0]).wait_for_workers(2, timeout=60)
            client = pool.client_for(points[1])

            def set_up(dask_worker) -> bool:
                from tasks.worker_state import _PROFILES
                return dask_worker.address in _PROFILES

            names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
            done = {names[a]: was for a, was in client.run(set_up).items()}
        finally:
            pool.close()
    finally:
        cluster.stop()
    assert [p.config.cluster.resource for p in points] == ["CPU", "OTHER"]
    assert done["other"], done


def test_a_rows_prediction_error_is_its_own_predicted_over_its_step():
    """Two repeats (predicted 0.03 and 0.0286 s, measured 0.03 and 0.0372 s): the row
    showed the repeats' median error (-15.5 %) beside medians whose ratio is -13 %."""
    ds = xr.Dataset(
        {"status": (("strategy", "repeat"), [[DONE, DONE]]),
         "failure": (("strategy", "repeat"), [["", ""]]),
         "step_time": (("strategy", "repeat"), [[0.03, 0.0372]]),
         "predicted_step_time": (("strategy", "repeat"), [[0.03, 0.0286]]),
         "prediction_error": (("strategy", "repeat"), [[0.0, 0.0286 / 0.0372 - 1]])},
        coords={"strategy": ["kernel"], "repeat": [0, 1]})
    (row,) = summary_table(ds).to_dict("records")
    assert row["prediction_error"] == pytest.approx(row["predicted_step_time"]
                                                    / row["step_time"] - 1)
    assert row["prediction_error"] == pytest.approx(0.0293 / 0.0336 - 1)


def test_a_sweep_whose_points_never_run_its_speedup_baseline_says_so(tmp_path):
    """task_steps.yaml and links.yaml name `speedup_baseline: single` and run no
    `single`: their stores' speedup and efficiency were empty, said only by the report."""
    from experiments.sweep.speedup import missing_baseline_note
    without = load_sweep(write_sweep(tmp_path, "d.zarr", {"strategy": ["kernel", "data"]},
                                     name="without", speedup_baseline="single"))
    assert missing_baseline_note(without) == (
        "note: no speedup or efficiency: speedup_baseline is single, which no point runs "
        "(set speedup_baseline to a strategy the sweep runs, or add it to the strategies)")
    with_it = load_sweep(write_sweep(tmp_path, "d.zarr", {"strategy": ["single", "kernel"]},
                                     name="with", speedup_baseline="single"))
    assert missing_baseline_note(with_it) is None
