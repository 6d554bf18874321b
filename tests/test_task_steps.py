"""How many steps a task runs, and each step's time within it (pipeline/engine/task_steps.py):
pure; and the training loop that applies them, over a fake trainer."""

import gc
import io
import itertools
import statistics
import sys
import time

import pytest

from pipeline.training import loop
from pipeline.config.run_config import build_run_config
from pipeline.records.record import RunRecorder, StepResult
from pipeline.engine.task_steps import (MAX_STEPS_PER_TASK, RECENT_STEPS, TASK_SECONDS, StepClock,
                                        median_task_steps, next_task_steps, planned_task_steps,
                                        step_times, steps_label, steps_per_task)
from tasks.receipts import Receipt


def test_auto_sizes_a_task_to_about_a_second_within_its_bounds():
    assert steps_per_task("auto", None) == 1  # nothing measured yet
    assert steps_per_task("auto", TASK_SECONDS / 10) == 10
    assert steps_per_task("auto", TASK_SECONDS / 10 * 1.05) == 9  # never longer than aimed
    assert steps_per_task("auto", 3 * TASK_SECONDS) == 1  # a long step: a task per step
    assert steps_per_task("auto", 1e-6) == MAX_STEPS_PER_TASK
    assert steps_per_task("auto", float("nan")) == 1 and steps_per_task("auto", 0.0) == 1
    assert steps_per_task(7, 5.0) == 7 and steps_per_task(1, 1e-6) == 1  # as set


def test_a_task_stops_at_the_next_checkpoint_and_sizes_by_the_steady_steps():
    assert next_task_steps(0, 20, 4, []) == 4
    assert next_task_steps(18, 20, 4, []) == 2  # the checkpoint after step 19 cuts it
    assert next_task_steps(0, 20, "auto", []) == 1
    assert next_task_steps(5, 100, "auto", [0.1, 0.1, 0.3, 0.1]) == 10  # the median
    with pytest.raises(ValueError, match="no steps"):
        next_task_steps(20, 20, 4, [])
    # the loop's first step (a warm-up) counts only until another is measured
    clock = StepClock()
    assert list(clock.steps()) == []
    clock.add([2.0])
    assert list(clock.steps()) == [2.0]
    clock.add([0.1, 0.2])
    assert list(clock.steps()) == [0.1, 0.2]
    clock.add([0.1] * (RECENT_STEPS + 5))  # a long run keeps only the latest
    assert list(clock.steps()) == [0.1] * RECENT_STEPS


def test_steps_after_a_step_of_the_same_workers_run_from_its_end():
    assert step_times([10.3, 10.5, 10.6], 10.0, wall_s=0.7) == pytest.approx([0.3, 0.2, 0.1])
    # the client's own wait plays no part once the previous end is known
    assert step_times([10.3], 10.0, wall_s=5.0) == pytest.approx([0.3])


def test_the_first_step_after_a_checkpoint_takes_the_clients_time_less_the_others():
    times = step_times([10.3, 10.5, 10.6], None, wall_s=0.9)
    assert times == pytest.approx([0.6, 0.2, 0.1])
    assert sum(times) == pytest.approx(0.9)  # the steps add up to what the client waited
    assert step_times([10.3, 10.5], None, wall_s=0.1)[0] == 0.0  # never below zero
    assert step_times([], None, 1.0) == []


def test_a_task_is_named_by_its_steps():
    assert steps_label(4, 1) == "step 4" and steps_label(4, 10) == "steps 4-13"


class FakeTrainer:
    """The loop's trainer interface over a fake clock, the client's and the workers'
    alike: each step takes `step_s` (its receipt's end)."""

    devices = ["cpu"]

    def __init__(self, step_s: float) -> None:
        self.step_s, self.now = step_s, 1000.0
        self.tasks: list[tuple[int, int]] = []
        self.in_flight: dict[int, int] = {}
        self.most_in_flight = 0

    def submit(self, first: int, count: int) -> None:
        self.tasks.append((first, count))
        self.in_flight[first] = count
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))

    def collect(self, first: int) -> list[StepResult]:
        results = []
        for step in range(first, first + self.in_flight.pop(first)):
            receipt = Receipt(f"step-{step}", "w0", step, self.now)
            self.now += self.step_s
            receipt.end, receipt.loss = self.now, 1.0
            results.append(StepResult(step, 1.0, [receipt]))
        return results

    def show_waits(self, note) -> None:  # noqa: ANN001 - the Trainer protocol's
        pass


def _loop(monkeypatch, tmp_path, trainer: FakeTrainer, **train) -> tuple[RunRecorder, list]:
    saved: list[int] = []
    monkeypatch.setattr(loop, "save_checkpoint",
                        lambda config, trainer, since, done, samples: saved.append(done))
    monkeypatch.setattr(loop.time, "perf_counter", lambda: trainer.now)  # the client's too
    config = build_run_config({"name": "fake", "progress": False,
                               "output": str(tmp_path / "run")},
                              [f"train.{key}={value}" for key, value in train.items()])
    recorder = RunRecorder(["w0"], ["w0"], [1.0])
    assert loop.train_loop(config, trainer, recorder, [], 0, 512) == config.train.steps
    return recorder, saved


def test_the_loop_cuts_tasks_at_checkpoints_and_times_steps_by_their_ends(monkeypatch,
                                                                         tmp_path):
    trainer = FakeTrainer(step_s=0.25)
    recorder, saved = _loop(monkeypatch, tmp_path, trainer, steps=10, checkpoint_every=4,
                            steps_per_task=3, inflight=1)
    assert trainer.tasks == [(0, 3), (3, 1), (4, 3), (7, 1), (8, 2)]
    assert saved == [4, 8, 10] and trainer.most_in_flight == 1
    times = {s: v["step_time"] for s, v in recorder.steps.items()}
    sizes = [recorder.steps[s]["task_steps"] for s in range(10)]
    assert sizes == [3, 3, 3, 1, 3, 3, 3, 1, 2, 2]
    # every step its own 0.25 s: after a step of the same workers from the receipts'
    # ends; the first after the start or a checkpoint (0, 4, 8) as the client's wait
    # less the task's other steps
    assert times == pytest.approx({step: 0.25 for step in range(10)})


def test_auto_grows_tasks_once_steps_are_timed_and_keeps_two_in_flight(monkeypatch,
                                                                       tmp_path):
    trainer = FakeTrainer(step_s=TASK_SECONDS / 8)
    recorder, saved = _loop(monkeypatch, tmp_path, trainer, steps=40)
    assert saved == [40] and trainer.most_in_flight == 2
    counts = [count for _first, count in trainer.tasks]
    assert counts[:2] == [1, 1]  # nothing timed yet
    assert max(counts) == 8 and counts.count(8) >= 3  # then tasks of about a second
    assert sum(counts) == 40


@pytest.mark.parametrize("train", [
    {"steps": 40},
    {"steps": 4},
    {"steps": 10, "checkpoint_every": 4, "steps_per_task": 3, "inflight": 1},
    {"steps": 23, "checkpoint_every": 7, "inflight": 3},
    {"steps": 2, "inflight": 1},
])
def test_the_tasks_planned_before_a_run_are_those_the_loop_runs(monkeypatch, tmp_path, train):
    """A prediction made before a run prices the per-task costs by the tasks the loop
    will run (`planned_task_steps`): at a steady step, the same size for every step."""
    step_s = TASK_SECONDS / 8
    recorder, _ = _loop(monkeypatch, tmp_path, FakeTrainer(step_s), **train)
    ran = [recorder.steps[s]["task_steps"] for s in range(train["steps"])]
    assert planned_task_steps(train.get("steps_per_task", "auto"), step_s, train["steps"],
                              train.get("checkpoint_every", 0),
                              train.get("inflight", 2)) == ran


def test_a_short_run_is_priced_at_the_tasks_it_runs_not_a_long_runs():
    """Four steps at 10 ms: tasks of 1, 1 and 2 steps, median 2 over the timed steps
    (the first is a warm-up); a long run's tasks hold 32 (at most `MAX_STEPS_PER_TASK`)."""
    assert planned_task_steps("auto", 0.01, 4, 0, 2) == [1, 1, 2, 2]
    assert median_task_steps("auto", 0.01, 4, 0, 2, warmup_steps=1) == 2.0
    assert median_task_steps("auto", 0.01, 200, 0, 2, 1) == MAX_STEPS_PER_TASK
    assert median_task_steps(1, 0.01, 200, 0, 2, 1) == 1.0
    assert median_task_steps("auto", 0.01, 1, 0, 2, warmup_steps=5) == 1.0  # all warm-up


@pytest.mark.parametrize("setting", ["auto", 1, 3])
def test_the_median_task_is_counted_as_the_steps_planned_are(setting):
    """`median_task_steps` counts steps by their task's size, period by period, and
    gives what the median of every planned step gives."""
    for steps, every, inflight, warmup in itertools.product(
            [1, 2, 5, 12, 37], [0, 1, 2, 5, 11, 40], [1, 2, 3], [0, 1, 4, 13, 50]):
        for step_s in (None, 0.01, TASK_SECONDS / 4, 2.0):
            sizes = planned_task_steps(setting, step_s, steps, every, inflight)
            assert len(sizes) == steps
            assert (median_task_steps(setting, step_s, steps, every, inflight, warmup)
                    == int(statistics.median(sizes[warmup:] or sizes))), (steps, every)


def test_a_huge_run_is_planned_at_once():
    """A run of 10^9 steps (`TrainConfig.MAX_STEPS`) with a checkpoint after each, or
    none, in tasks of a step: planned in a moment, not step by step (it took minutes
    and gigabytes)."""
    started = time.perf_counter()
    assert median_task_steps(1, 0.01, 10**9, 1, 2, 1) == 1
    assert median_task_steps("auto", 0.01, 10**9, 0, 2, 10**6) == MAX_STEPS_PER_TASK
    assert median_task_steps("auto", 0.01, 10**9, 3, 2, 10**8) == 3
    assert time.perf_counter() - started < 10.0  # step by step: minutes (a bound, not a benchmark)


class WarningTrainer(FakeTrainer):
    """A fake trainer that prints a warning line to standard error while collecting
    step 3, as a worker joining mid-run is said."""

    def collect(self, first: int) -> list[StepResult]:
        if first == 3:
            print("warning: worker w9 joined the cluster but runs other code",
                  file=sys.stderr, flush=True)
        return super().collect(first)


def test_a_line_said_during_the_loop_clears_the_bar_first(monkeypatch, tmp_path):
    """With the progress bar drawn, a warning was appended to the bar's line
    (`...step_s=0.100]warning: ...`); now the bar is cleared first and drawn again
    after it."""
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    trainer = WarningTrainer(step_s=0.25)
    saved: list[int] = []
    monkeypatch.setattr(loop, "save_checkpoint",
                        lambda config, trainer, since, done, samples: saved.append(done))
    config = build_run_config({"name": "fake", "progress": True,
                               "output": str(tmp_path / "run")},
                              ["train.steps=6", "train.steps_per_task=1"])
    loop.train_loop(config, trainer, RunRecorder(["w0"], ["w0"], [1.0]), [], 0, 512)
    text = err.getvalue()
    at = text.index("warning: worker w9")
    assert text[at - 1] in "\r\n", repr(text[max(0, at - 60):at + 20])
    assert text.rstrip().count("warning:") == 1 and "fake [" in text[at:]  # drawn again


class FreezeWatchingTrainer(FakeTrainer):
    """A fake trainer that notes, at each submit, how many objects the garbage
    collector has frozen; its collect fails at step `fail_at` (None: never)."""

    def __init__(self, step_s: float, fail_at: int | None = None) -> None:
        super().__init__(step_s)
        self.frozen: list[int] = []
        self.fail_at = fail_at

    def submit(self, first: int, count: int) -> None:
        self.frozen.append(gc.get_freeze_count())
        super().submit(first, count)

    def collect(self, first: int) -> list[StepResult]:
        if first == self.fail_at:
            raise RuntimeError("a worker was lost")
        return super().collect(first)


def test_the_loop_runs_with_the_heap_frozen_and_hands_it_back(monkeypatch, tmp_path):
    """Everything alive when the loop starts is out of the full collections' walk
    while it runs (a full collection in a run's client took 0.18 s inside a step), and
    collectable again after it, however it ends (a sweep's process runs many loops)."""
    gc.unfreeze()
    trainer = FreezeWatchingTrainer(step_s=0.25)
    _loop(monkeypatch, tmp_path, trainer, steps=6, checkpoint_every=3, steps_per_task=1)
    assert len(trainer.frozen) == 6 and min(trainer.frozen) > 10_000, trainer.frozen
    assert gc.get_freeze_count() == 0
    failing = FreezeWatchingTrainer(step_s=0.25, fail_at=2)
    with pytest.raises(RuntimeError, match="a worker was lost"):
        _loop(monkeypatch, tmp_path, failing, steps=6, steps_per_task=1, inflight=1)
    assert failing.frozen and min(failing.frozen) > 10_000
    assert gc.get_freeze_count() == 0
