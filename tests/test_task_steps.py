"""How many steps a task runs, and each step's time within it (pipeline/task_steps.py):
pure."""

import pytest

from pipeline.task_steps import (MAX_STEPS_PER_TASK, RECENT_STEPS, TASK_SECONDS, StepClock,
                                 next_task_steps, step_times, steps_label, steps_per_task)


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
