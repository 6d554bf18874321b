"""SIGTERM to a real `python -m pipeline.train` on its embedded cluster: it stops as
from Ctrl-C, says where to continue from and how, leaves no process or workspace,
exits 143; the printed command continues the run to its end exactly (the seed's
batches, plain PyTorch's float64 weights). The same for a real
`python -m experiments.sweep`: the same command, run again, runs only the points
not finished, and those finished keep their figures. The signalled runs are real
processes; the commands that resume them run their `main` in the test's process
(the same arguments, one interpreter start less each).

Rows of tests/test_faults.py's `FAULTS` (and so of docs/reliability.md's table).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import xarray as xr

from experiments.sweep.store_layout import DONE
from pipeline.cli import SAME_STOP_S
from pipeline.config.run_config import load_run_config
from pipeline.engine.sampler import step_indices
from storage import checkpoints
from tasks.setup_gate import SETUP_NAME
from tasks.worker_state import WorkerSetup, _DropSetupNeverInstalled
from tests.helpers import max_relative_error, replay_in_pytorch, run_main, wait_exited
from tests.test_cli import ROOT, run_files, tiny_args
from tests.test_faults import FAULTS, train_process, wait_for_checkpoint
from tests.test_semaphores import semaphores_of
from tests.test_sweep import write_sweep

SHM = f"/dev/shm/dask-cnn-{os.getuid()}"


def workspaces_of(pid: int) -> list[str]:
    """The workspaces in /dev/shm whose owner record names process `pid`."""
    found = []
    for name in os.listdir(SHM) if os.path.isdir(SHM) else []:
        try:
            with open(os.path.join(SHM, name, "owner.json"), encoding="utf-8") as handle:
                if json.load(handle).get("pid") == pid:
                    found.append(name)
        except (OSError, ValueError):
            continue
    return found


def stop_with(process: subprocess.Popen, signum: int) -> list[str]:
    """Send `signum` to `process` and wait for it to end: its non-empty stderr lines,
    once it has exited 128 + `signum` leaving no child process and no workspace."""
    try:
        children = psutil.Process(process.pid).children(recursive=True)
        process.send_signal(signum)
        _out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signum, err
    alive = wait_exited(children, timeout=10)
    assert children and not alive, alive
    # a zombie has exited, but a process started after `children` was listed (a
    # probe's) may still be on its way out: its cleanup gets the same 10 s
    deadline = time.monotonic() + 10
    while (workspaces_of(process.pid) or semaphores_of(process.pid)) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert not workspaces_of(process.pid)
    assert semaphores_of(process.pid) == []  # of its workers' queues (6 a worker)
    return [line for line in err.splitlines() if line.strip()]


def test_sigterm_stops_cleanly_and_the_printed_command_resumes(tmp_path, tiny_dataset_factory,
                                                               monkeypatch):
    assert FAULTS["run SIGTERMed mid-run, then resumed"] == "clean"
    monkeypatch.setenv("PYTHONPATH", ROOT)
    steps = 30  # SIGTERMed soon after checkpoint 5 (about 0.03 s a step): 25 steps of margin
    dataset = tiny_dataset_factory("float64")
    args = [*tiny_args(tmp_path, dataset), "--fresh", "network.dtype=float64",
            "placement=even",  # not about placement: calibrating costs each run about 4 s
            f"train.steps={steps}", "train.checkpoint_every=5", "train.eval_samples=0"]
    run = train_process(*args)
    path = str(tmp_path / "run" / "checkpoints.zarr")
    try:
        wait_for_checkpoint(path, 5, run)
        assert workspaces_of(run.pid)  # `stop_with` would notice its removal
    except BaseException:
        run.kill()
        raise
    lines = stop_with(run, signal.SIGTERM)
    assert len(lines) == 1, lines  # and so no "leaked semaphore" warning either
    last = checkpoints.latest_complete_step(path)
    assert lines[0].startswith(f"interrupted (SIGTERM): the last complete checkpoint is "
                               f"step {last} ") and last >= 5, lines
    command = shlex.split(lines[0].split("continue from it with: ", 1)[1])
    assert command[-1] == "train.resume=true" and "--fresh" not in command
    assert command[:3] == [sys.executable, "-m", "pipeline.train"], command
    status, err_lines, _out = run_main("train", command[3:])  # its main, in this process
    assert status == 0, err_lines
    record = xr.open_zarr(tmp_path / "run" / "record.zarr")
    # the whole run's record: the stopped start's steps up to its checkpoint, then the
    # resumed start's
    assert list(record.step.values) == list(range(steps))
    assert list(record.start.values) == [0] * last + [1] * (steps - last)
    assert checkpoints.latest_complete_step(path) == steps
    # exactly: every step's batch is the seed's, and the weights are plain PyTorch's on them
    config = load_run_config(args[0], [a for a in args[1:] if not a.startswith("--")])
    train = config.train
    assert (checkpoints.read_sample_indices(path) == np.stack(
        [step_indices(train.seed, s, train.batch, 512) for s in range(steps)])).all()
    expected, _ = replay_in_pytorch(config, dataset)
    assert max_relative_error(checkpoints.read_tensors(path, steps), expected) <= 1e-10


def interrupt_after_checkpoint(args: list[str], checkpoint: int, path: str) -> int:
    """Start ``python -m pipeline.train ARGS``, SIGINT it once checkpoint `checkpoint`
    (or a later one) is complete, and check that it stops as a stopped run does: one
    line naming its last complete checkpoint, exit 130, within seconds. Returns that
    checkpoint's step."""
    run = train_process(*args)
    try:
        wait_for_checkpoint(path, checkpoint, run)
        run.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        _out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 130, err
    assert time.monotonic() - signalled < 20, err  # writing the record keeps it quick
    last = checkpoints.latest_complete_step(path)
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith(f"interrupted (SIGINT): the last complete checkpoint is "
                                f"step {last} "), lines
    return last


def test_a_run_stopped_twice_and_resumed_keeps_every_step_once(tmp_path, tiny_dataset_factory,
                                                               monkeypatch):
    """A run SIGINTed after a checkpoint, resumed and SIGINTed again, then resumed to its
    end: its record holds every step its final weights went through, once and in
    order, each marked with the start that ran it; the steps of the earlier starts
    keep the figures they were recorded with, and those an earlier start ran past the
    checkpoint resumed from are the later start's. The summary covers them all, less
    each start's warm-up step. Before, a stopped run wrote no record and a resume
    replaced the record with its own steps: the steps of earlier starts were lost."""
    monkeypatch.setenv("PYTHONPATH", ROOT)
    args = [*tiny_args(tmp_path, tiny_dataset_factory("float32")), "strategy=reference",
            "train.checkpoint_every=4", "train.eval_samples=0", "train.warmup_steps=1"]
    output = tmp_path / "run"
    path = str(output / "checkpoints.zarr")

    def record() -> xr.Dataset:
        with xr.open_zarr(output / "record.zarr") as stored:
            return stored.load()

    first = interrupt_after_checkpoint([*args, "train.steps=100000"], 4, path)
    stopped_first = record()  # every step it measured, those past its checkpoint too
    assert list(stopped_first.step.values) == list(range(stopped_first.sizes["step"]))
    assert stopped_first.sizes["step"] >= first and set(stopped_first.start.values) == {0}
    second = interrupt_after_checkpoint([*args, "train.steps=100000", "train.resume=true"],
                                        first + 8, path)
    stopped_second = record()
    steps = second + 3
    status, lines, _out = run_main("train", [*args, f"train.steps={steps}",
                                             "train.resume=true"])
    assert status == 0, lines
    if stopped_second.step.values.max() >= second:  # ran past its checkpoint: replaced
        assert any(line.startswith(f"record: steps {second}") and "of start 1 ran past "
                   f"checkpoint {second}" in line for line in lines), lines
    final = record()
    assert list(final.step.values) == list(range(steps))  # every step once, in order
    assert list(final.start.values) == [0] * first + [1] * (second - first) + [2] * 3
    for earlier, (begin, end) in ((stopped_first, (0, first)),
                                  (stopped_second, (first, second))):
        for name in ("loss", "step_time", "compute_time", "client_cpu_time"):
            np.testing.assert_array_equal(final[name].sel(step=slice(begin, end - 1)).values,
                                          earlier[name].sel(step=slice(begin, end - 1)).values)
    starts = json.loads(final.attrs["starts"])
    assert [(s["start"], s["from_step"], s["ended"]) for s in starts] == [
        (0, 0, "SIGINT"), (1, first, "SIGINT"), (2, second, "complete")]
    summary = json.loads((output / "summary.json").read_text())
    assert summary["recorded_steps"] == steps and summary["ended"] == "complete"
    assert summary["warmup_steps_left_out"] == [0, first, second]
    assert summary["measured_steps"] == steps - 3
    assert summary["step_time_median"] == float(np.median(np.delete(
        final.step_time.values, [0, first, second])))


def test_sigterm_stops_a_sweep_cleanly_and_the_same_command_resumes(tmp_path,
                                                                     tiny_dataset_factory,
                                                                     monkeypatch):
    """A sweep of two `kernel` points on its embedded cluster, SIGTERMed once its
    first point is done: one line saying how to resume, exit 143, no process or
    workspace left; the same command again runs only the rest, and the points done
    before keep their run and figures."""
    assert FAULTS["sweep SIGTERMed mid-sweep, then run again"] == "clean"
    monkeypatch.setenv("PYTHONPATH", ROOT)
    monkeypatch.setenv("CNN_PREDICT_PROBE", "never")  # no model probes: points stay short
    monkeypatch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))
    config = write_sweep(tmp_path, tiny_dataset_factory("float32"),
                         {"train.batch": [8, 16]})
    store = tmp_path / "sweep.zarr"
    command = [sys.executable, "-m", "experiments.sweep.cli", config, "--out", str(store)]
    sweep = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        for line in sweep.stdout:  # a point's line ends "... s/step ..."
            if "s/step" in line:
                break
    except BaseException:
        sweep.kill()
        raise
    assert stop_with(sweep, signal.SIGTERM) == [
        "interrupted (SIGTERM): finished points are kept; run the same command again to "
        "resume"]  # one line: no "leaked semaphore" either
    ds = xr.open_zarr(store).load()
    done = np.flatnonzero(ds.status.values.ravel() == DONE)
    before = {i: (ds.run_id.values.ravel()[i], ds.step_time.values.ravel()[i]) for i in done}
    assert len(before) == 1, before  # the signal came before the second point ended
    status, err_lines, out = run_main("sweep", command[3:])  # its main, in this process
    assert status == 0, err_lines
    assert "1 done before, 1 to run" in out
    assert out.count("s/step") == 1
    ds = xr.open_zarr(store).load()
    assert (ds.status == DONE).all()
    for index, point in before.items():
        assert (ds.run_id.values.ravel()[index], ds.step_time.values.ravel()[index]) == point


def test_ctrl_c_while_the_model_probes_keeps_the_finished_run(tmp_path, tiny_dataset_factory,
                                                              monkeypatch):
    """Ctrl-C once every step is done, while `prediction: auto` probes the cluster (no
    probe cached): the probe ends, its workspace goes, and the run writes its record
    and summary (without a prediction, saying why) before one line says it is
    complete; exit 130. Resumed, it says it is complete and changes nothing."""
    assert FAULTS["run Ctrl-Ced while the model probes, after its last step, "
                  "then resumed"] == "clean"
    monkeypatch.setenv("PYTHONPATH", ROOT)
    monkeypatch.setenv("CNN_PROBE_CACHE", str(tmp_path / "probes"))  # nothing cached
    args = [*tiny_args(tmp_path, tiny_dataset_factory("float32")), "placement=even",
            "prediction=auto"]
    run = train_process(*args)
    output = tmp_path / "run"
    try:
        deadline = time.monotonic() + 120
        while not any(name.startswith("probe-") for name in workspaces_of(run.pid)):
            assert run.poll() is None, run.communicate()
            assert time.monotonic() < deadline, "the probe did not start"
            time.sleep(0.02)
    except BaseException:
        run.kill()
        raise
    assert stop_with(run, signal.SIGINT) == [
        f"interrupted (SIGINT) after the last step: the run is complete, its record and "
        f"summary are written ({output}); nothing to continue"]
    summary = json.loads((output / "summary.json").read_text())
    assert summary["predicted_step_time"] is None
    assert summary["prediction_note"].startswith("stopped (SIGINT) while the model probed")
    assert xr.open_zarr(output / "record.zarr").sizes["step"] == 3
    before = run_files(output)
    status, lines, out = run_main("train", [*args, "train.resume=true"])
    assert (status, lines) == (0, []) and "is complete" in out, (status, lines, out)
    assert run_files(output) == before


SLOW_CLEANUP = """
import multiprocessing, os, time
from pipeline.cli import Interrupted, stops_on_signals
from pipeline.cluster.semaphores import start_resource_tracker, tag_semaphores_with_pid
from storage.exchange import SlotSpec, create_exchange
from storage.private import default_workspace_root
try:
    with stops_on_signals():
        try:  # a workspace of this process's, as a run's (or its probe's)
            create_exchange(os.path.join(default_workspace_root(), f"stopped-{os.getpid()}.zarr"),
                            [SlotSpec("act/0/1", (2, 4), "float32")])
            tag_semaphores_with_pid()  # and a semaphore, as a nanny's queue has, and the
            start_resource_tracker()  # tracker, which would warn of it as leaked
            queue_lock = multiprocessing.get_context("forkserver").Lock()
            print("ready", flush=True)
            time.sleep(60)
        finally:  # a run's cleanup (closing the cluster) that hangs
            print("unwinding", flush=True)
            time.sleep(60)
except Interrupted:
    pass
"""


def _script(monkeypatch, script: str, *args: str) -> subprocess.Popen:
    """`script` run by this Python as a process of its own, with this tree's code, its
    output read as text (the signal tests' scripts print each stage they reach)."""
    monkeypatch.setenv("PYTHONPATH", ROOT)
    return subprocess.Popen([sys.executable, "-c", script, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_second_signal_stops_at_once(monkeypatch):
    """SIGHUP starts the unwinding; a SIGTERM during it ends the process at once,
    exit 143, without waiting for the cleanup, and removes the workspace it made and
    unlinks its semaphore itself (its resource tracker would, with a warning)."""
    process = _script(monkeypatch, SLOW_CLEANUP)
    try:
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signal.SIGHUP)
        assert process.stdout.readline().strip() == "unwinding"
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 128 + signal.SIGTERM
        assert time.monotonic() - started < 5
        assert semaphores_of(process.pid) == []
        err = process.stderr.read()  # to its end: the tracker's too, once it has ended
        assert "stopped at once by a second signal (SIGTERM)" in err
        assert "leaked semaphore" not in err, err
        assert not workspaces_of(process.pid)
    finally:
        if process.poll() is None:
            process.kill()


SIGNALLED_AGAIN = """
import sys, time
from pipeline import cli
cli.SAME_STOP_S = float(sys.argv[1])
try:
    with cli.stops_on_signals():
        try:
            print("ready", flush=True)
            time.sleep(60)
        finally:  # a run's cleanup, long enough to be signalled again
            print("unwinding", flush=True)
            time.sleep(2)
            print("unwound", flush=True)
except cli.Interrupted as stop:
    print(stop.name, flush=True)
"""


@pytest.mark.parametrize("same_stop_s, again_after_s, at_once", [(30.0, 0.0, False),
                                                                 (0.2, 0.6, True)])
def test_the_same_signal_again_at_once_is_the_same_stop(monkeypatch, same_stop_s,
                                                        again_after_s, at_once):
    """coreutils' `timeout` sends its signal to the command, then to its process group:
    the same signal again within `SAME_STOP_S` of the first is that stop, and the
    run unwinds as from one; later, it is a second stop, and stops at once. (The
    window is widened here, so that a loaded machine's delay cannot pass it.)"""
    process = _script(monkeypatch, SIGNALLED_AGAIN, str(same_stop_s))
    try:
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signal.SIGINT)
        assert process.stdout.readline().strip() == "unwinding"
        time.sleep(again_after_s)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
        if at_once:
            assert process.returncode == 128 + signal.SIGINT, (out, err)
            assert "stopped at once by a second signal (SIGINT)" in err and out == "", out
        else:
            assert process.returncode == 0, err
            assert out.split() == ["unwound", "SIGINT"] and "stopped at once" not in err
    finally:
        if process.poll() is None:
            process.kill()


SWALLOWED_STOP = """
import gc, os, signal, sys, time
from pipeline.cli import Interrupted, quiet_start, stops_on_signals


fired = []


def diagnose(phase, info):  # Python run by the garbage collector, as Dask's GC diagnosis
    if phase == "start" and not fired:  # once: not again in the collection at exit,
        fired.append(phase)  # where the stop may have come before its removal below
        os.kill(os.getpid(), signal.SIGINT)  # its handler's exception: raised in here


block = quiet_start() if sys.argv[1] == "starting" else stops_on_signals()
try:
    with block:
        gc.callbacks.append(diagnose)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(diagnose)
        time.sleep(1)
        print("went on", flush=True)
except Interrupted as stop:
    print("stopped by", stop.name, flush=True)
"""


@pytest.mark.parametrize("block", ["running", "starting"])
def test_a_stop_raised_inside_a_garbage_collection_is_not_lost(monkeypatch, block):
    """Ctrl-C while the garbage collector ran Dask's GC diagnosis: the handler's
    exception, raised in that callback, was printed as "Exception ignored in" and
    dropped, and the run finished with exit 0 (seen in a probe cut by Ctrl-C). The
    stop is now raised again once the collection is over, in a run
    (`stops_on_signals`) as in a command's imports (`quiet_start`)."""
    process = _script(monkeypatch, SWALLOWED_STOP, block)
    out, err = process.communicate(timeout=30)
    assert "went on" not in out and "Exception ignored" not in err, (out, err)
    if block == "running":
        assert (process.returncode, out) == (0, "stopped by SIGINT\n"), (out, err)
    else:
        assert process.returncode == 128 + signal.SIGINT, (out, err)
        assert err.splitlines() == [
            "interrupted (SIGINT) while starting: nothing was run or written"], err


RESULTS_FIRST = """
import os, signal
from pipeline.cli import Interrupted, ResultsFirst, stops_on_signals

def probe():
    os.kill(os.getpid(), signal.SIGINT)  # cuts the probe short
    return "probed"

try:
    with stops_on_signals(), ResultsFirst() as finish:
        finish.hold()
        os.kill(os.getpid(), signal.SIGTERM)  # after the last step: noted
        print("went on", flush=True)
        print(finish.unless_stopped(probe, lambda name: "skipped after " + name), flush=True)
        print("results written", flush=True)
except Interrupted as stop:
    print(stop.name, stop.after_last_step, flush=True)
with stops_on_signals(), ResultsFirst() as finish:
    finish.hold()
    print(finish.unless_stopped(lambda: "probed", str), flush=True)
try:
    with stops_on_signals(), ResultsFirst() as finish:
        finish.hold()
        print(finish.unless_stopped(probe, lambda name: "stopped in it by " + name), flush=True)
except Interrupted as stop:
    print(stop.name, stop.after_last_step, flush=True)
"""


def test_a_stop_after_the_last_step_waits_for_the_results(monkeypatch):
    """`ResultsFirst`: once held, a first stop signal is noted and raised only when the
    block ends (marked as after the last step); work run through `unless_stopped` is
    skipped after it, or cut short by one during it, and the block goes on."""
    monkeypatch.setenv("PYTHONPATH", ROOT)
    result = subprocess.run([sys.executable, "-c", RESULTS_FIRST], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.splitlines() == [
        "went on", "skipped after SIGTERM", "results written", "SIGTERM True",
        "probed", "stopped in it by SIGINT", "SIGINT True"], result.stderr


def test_removing_a_setup_a_worker_never_had_is_not_logged():
    """A sweep stopped while it restarts its workers removes its setup from workers
    that joined before the scheduler installed it there (a KeyError in Dask's
    `plugin_remove`): nothing to take down, so no traceback on the sweep's stderr
    (the test above met one under load). Any other teardown failure is still logged;
    the filter is there from the module's import, before any setup ran."""
    def record(name: str, error: type[BaseException]) -> logging.LogRecord:
        try:
            raise error(name)
        except BaseException:
            return logging.LogRecord("distributed.worker", logging.ERROR, __file__, 1,
                                     "Worker plugin %s failed to teardown", (name,),
                                     sys.exc_info())

    assert WorkerSetup.name == SETUP_NAME  # the plugin's name, kept apart from torch's import
    ours = f"{WorkerSetup.name}-Client-1234"
    assert any(isinstance(f, _DropSetupNeverInstalled)
               for f in logging.getLogger("distributed.worker").filters)
    drop = _DropSetupNeverInstalled()
    assert not drop.filter(record(ours, KeyError))
    assert drop.filter(record(ours, RuntimeError))  # a teardown that really failed
    assert drop.filter(record("someone-elses-plugin", KeyError))


#: A `sitecustomize` that sends its process SIGINT as the process starts importing
#: numpy (which torch, Dask, xarray all import first): a Ctrl-C in a command's first
#: second, at a moment the test chooses.
SIGINT_AT_IMPORT = """
import os, signal, sys

class CtrlCAtImport:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlCAtImport())
"""


@pytest.mark.parametrize("command", [["pipeline.train", "configs/small.yaml", "--check"],
                                     ["experiments.sweep", "experiments/configs/quick.yaml",
                                      "--dry-run"],
                                     ["experiments.report", "results/none.zarr"]])
def test_a_ctrl_c_while_a_command_imports_is_one_line(tmp_path, monkeypatch, command):
    """Ctrl-C in a command's first second or two (its imports) printed a 30-line
    traceback of whichever import it cut; now one line, and exit 130 as later."""
    (tmp_path / "sitecustomize.py").write_text(SIGINT_AT_IMPORT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), ROOT]))
    done = subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGINT, done.stderr
    assert done.stderr.splitlines() == [
        "interrupted (SIGINT) while starting: nothing was run or written"], done.stderr
    assert done.stdout == ""


REPORT_STOPPED_WHILE_DRAWING = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's background job starts it
from experiments.report import cli
from experiments.scaling import report

drawn = report.speedup_figure


def draw_then_ctrl_c(*args):
    drawn(*args)
    os.kill(os.getpid(), signal.SIGINT)
    return True


report.speedup_figure = draw_then_ctrl_c
sys.exit(cli.main(sys.argv[1:]))
"""


def test_ctrl_c_while_a_report_draws_stops_it_and_leaves_no_half_report(tmp_path):
    """The report ignored it (the signals were left as its start found them: ignored,
    for a background job), finished, and exited 0; now one line, exit 130, and none of
    the report's files left (an earlier report's neither: it was being replaced)."""
    from experiments.sweep import cli as sweep_cli
    from tests.test_scaling import write_scaling
    store = str(tmp_path / "tinyscale.zarr")
    # the fewest points that still draw a figure (devices x batch) before the speedup
    # figure, so that the stop has a written figure to remove; no link axis: its
    # figure would cost the report another 1.5 s of CPU
    axes = {"strategy": ["single", "kernel"], "hardware.devices": [1, 2],
            "train.batch": [2, 16]}
    assert sweep_cli.main([write_scaling(tmp_path, axes), "--out", store]) == 0
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.md").write_text("an earlier report")
    done = subprocess.run([sys.executable, "-c", REPORT_STOPPED_WHILE_DRAWING, store, "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGINT, done.stderr
    assert done.stderr.splitlines() == [
        "interrupted (SIGINT): no report was written (its partial files are removed); run "
        "the same command again"], done.stderr
    assert done.stdout == "" and os.listdir(out) == []


SIGNALLED_AFTER = """
import time
from pipeline import cli
try:
    with cli.stops_on_signals():
        print("ready", flush=True)
        time.sleep(60)
except cli.Interrupted as stop:
    print("stopped", stop.name, flush=True)
    time.sleep(10)  # the process ending: writing its line, its exit's cleanup
"""


def test_a_second_signal_once_the_stop_has_unwound_stops_at_once(monkeypatch):
    """Once the first stop has unwound (its line written, the process ending), a
    second Ctrl-C raised a KeyboardInterrupt into whatever the exit ran: a traceback
    ("Exception ignored in: <function WeakSet...>"), and at times an exit by the
    signal itself (-2) rather than 130. It now stops at once, as during the unwinding."""
    process = _script(monkeypatch, SIGNALLED_AFTER)
    try:
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signal.SIGINT)
        assert process.stdout.readline().split() == ["stopped", "SIGINT"]
        time.sleep(SAME_STOP_S + 0.3)  # a second stop, not the first one delivered twice
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
        assert process.returncode == 128 + signal.SIGINT, err
        assert err.splitlines() == ["stopped at once by a second signal (SIGINT)"], err
    finally:
        if process.poll() is None:
            process.kill()
