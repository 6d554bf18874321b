"""The training loop: submit tasks of steps ahead, collect each as it finishes,
checkpoint.

The same loop drives every strategy (the distributed engine and the in-process
reference). The model's calibration runs (pipeline/probe/runs.py) drive the engine
the same way: warm-up steps one per task, then the measured steps in one task.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import deque
from typing import Any, Callable, Iterator, Protocol, TextIO

import numpy as np
from tqdm import tqdm

from pipeline.engine.checkpointing import save_checkpoint
from pipeline.engine.heap import heap_frozen
from pipeline.config.run_config import RunConfig
from pipeline.records.record import RunRecorder, StepResult
from pipeline.engine.task_steps import StepClock, next_task_steps, step_times, steps_label
from pipeline.records.trace import ClientEvent
from pipeline.strategies import strategy_named
from tasks.memory import read_peak, reset_peak


class Trainer(Protocol):
    """What the training loop drives: the distributed engine or the reference."""

    devices: list[str]

    def start(self, from_step: int) -> None: ...
    def submit(self, first: int, count: int) -> None: ...  # steps first .. first+count-1
    def collect(self, first: int) -> list[StepResult]: ...  # those steps, in order
    def checkpoint(self, done_steps: int) -> str | None: ...  # the attempt that staged it
    def show_waits(self, note: Callable[[str], None]) -> None: ...  # long waits, said
    def close(self) -> None: ...


def train_loop(config: RunConfig, trainer: Trainer, recorder: RunRecorder,
               client_events: list[ClientEvent], from_step: int, train_samples: int,
               stop_at_checkpoint: Callable[[int], bool] = lambda step: False) -> int:
    """Submit tasks ahead (`train.inflight`), collect each as it finishes, checkpoint.

    A task runs one or more consecutive steps (`train.steps_per_task`,
    pipeline/engine/task_steps.py). A step's time runs from the previous step's completion
    to its own (`task_steps.step_times`). No task runs past the next checkpoint: a
    checkpoint holds the state after exactly its step, and saving it is timed apart
    from every step. After each checkpoint before the last, `stop_at_checkpoint(step)`
    may end the loop there (nothing is in flight then). Returns the step reached.
    """
    bar = tqdm(total=config.train.steps, initial=from_step, unit="step",
               desc=f"{config.name} [{config.strategy}]", disable=not config.progress,
               file=sys.stderr, leave=False)
    # the bar is closed (its line cleared) on every way out, so an error's line stands alone;
    # a line printed meanwhile (a warning, from any thread) clears it first
    below = contextlib.redirect_stderr(BarSafeStream(sys.stderr)) if config.progress \
        else contextlib.nullcontext()
    with bar, below, heap_frozen():
        return _steps(config, trainer, recorder, client_events, from_step, train_samples,
                      stop_at_checkpoint, bar)


def _steps(config: RunConfig, trainer: Trainer, recorder: RunRecorder,
           client_events: list[ClientEvent], from_step: int, train_samples: int,
           stop_at_checkpoint: Callable[[int], bool], bar: tqdm) -> int:
    """`train_loop`'s steps, reporting to `bar`."""
    steps, ahead = config.train.steps, config.train.inflight
    setting = strategy_named(config.strategy).steps_per_task(config)
    # a long wait on a worker (a frozen one, before the stall limit) shows on the bar;
    # the next step's figures replace it
    trainer.show_waits(lambda note: bar.set_postfix_str(note, refresh=True))
    in_flight: deque[range] = deque()
    clock = StepClock()  # the step times that size `auto` tasks
    submitted, last_save, last_end = from_step, from_step, time.perf_counter()
    previous_end: float | None = None  # when the last collected step finished (workers)
    step = from_step
    while step < steps:
        next_save = config.next_checkpoint(step)
        kind = reset_peak()  # the client's own peak over this task's submits and collect
        cpu_start = time.process_time()  # the client's CPU (and an embedded scheduler's)
        while len(in_flight) < ahead and submitted < next_save:
            count = next_task_steps(submitted, next_save, setting, clock.steps())
            with _client_event(client_events, f"submit {steps_label(submitted, count)}"):
                trainer.submit(submitted, count)
            in_flight.append(range(submitted, submitted + count))
            submitted += count
        task = in_flight.popleft()
        with _client_event(client_events, f"collect {steps_label(task.start, len(task))}"):
            results = trainer.collect(task.start)
        now = time.perf_counter()
        times = step_times([r.finished for r in results], previous_end, now - last_end)
        client_peak, client_cpu = read_peak("cpu", kind), time.process_time() - cpu_start
        for result, seconds in zip(results, times, strict=True):
            recorder.add_step(result, seconds, client_peak, client_cpu / len(task), len(task))
            if not np.isfinite(result.loss):
                raise FloatingPointError(
                    f"training diverged at step {result.step}: loss is {result.loss}")
        clock.add(times)
        last_end, previous_end, step = now, results[-1].finished, task.stop
        if step == next_save:
            with _client_event(client_events, f"checkpoint {step}"):
                save_checkpoint(config, trainer, last_save, step, train_samples)
            last_save, previous_end = step, None
            # the join check is the checkpoint's, not the next step's (its question to
            # the scheduler is guarded: a thread beside it, pipeline/cluster/scheduler_guard.py)
            joined = step < steps and stop_at_checkpoint(step)
            recorder.checkpoint_s += time.perf_counter() - now
            last_end = time.perf_counter()
            if joined:
                return step
        bar.set_postfix(loss=f"{results[-1].loss:.3f}",
                        step_s=f"{recorder.steps[step - 1]['step_time']:.3f}")
        bar.update(len(task))
    return steps


class BarSafeStream:
    """Standard error while a progress bar is drawn on it: a line written clears the
    bar first, which is drawn again below it (tqdm's `external_write_mode`), rather
    than being appended to the bar's line (`...step_s=0.100]warning: ...`)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        with tqdm.external_write_mode(file=self.stream):
            return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding...
        return getattr(self.stream, name)


@contextlib.contextmanager
def _client_event(events: list[ClientEvent], name: str) -> Iterator[None]:
    """Time a stretch of the client's work for the trace's client lane."""
    start = time.time()
    try:
        yield
    finally:
        events.append(ClientEvent(name, start, time.time()))
