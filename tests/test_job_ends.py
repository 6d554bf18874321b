"""The batch jobs' walltime (pipeline/cluster/job_ends.py), as pure functions of the
config and of what Slurm says of the jobs: the start line names it (and says when it
is the default), a worker lost because its job reached it is said to be so, naming the
field to raise, and the run's and the sweep's last lines say to raise it. The same
read against a real Slurm is in tests/test_jobqueue.py and test_jobqueue_stops.py."""

from __future__ import annotations

import pytest

from experiments.sweep.run import one_line
from pipeline.cluster.job_ends import (submitting_line, timed_out, walltime_limits,
                                       walltime_note)
from pipeline.cluster.workers import WorkerLost
from pipeline.config.jobqueue_config import JobGroupConfig, JobqueueConfig
from pipeline.config.schema import FieldError
from pipeline.train import lost_line

DEFAULT = ("cluster.jobqueue.walltime", "01:00:00")


def test_the_start_line_names_the_walltime_and_when_it_is_the_default():
    assert submitting_line(JobqueueConfig(), 2) == (
        "starting 2 slurm job(s) for the workers, walltime 01:00:00 (the default of "
        "cluster.jobqueue.walltime)")
    assert submitting_line(JobqueueConfig(walltime="02:00:00"), 3) == (
        "starting 3 slurm job(s) for the workers, walltime 02:00:00")
    assert submitting_line(JobqueueConfig(walltime=None), 1).endswith(
        ", no walltime asked (the queue's time limit)")
    groups = JobqueueConfig(groups=[JobGroupConfig(jobs=1, walltime="04:00:00"),
                                    JobGroupConfig(jobs=2)])
    assert submitting_line(groups, 3).endswith(", walltimes 01:00:00, 04:00:00")
    assert walltime_limits(groups) == [("cluster.jobqueue.groups.0.walltime", "04:00:00"),
                                       DEFAULT]


def test_jobs_ended_at_their_walltime_are_told_from_jobs_ended_otherwise():
    """TIMEOUT (as `squeue -t all` and `sacct` say once it ended), or the reason
    TimeLimit (while it completes); a cancelled job, a running one or one no longer
    listed is no walltime end."""
    states = {"11": ("TIMEOUT", "TimeLimit", "debug"), "12": ("COMPLETING", "TimeLimit"),
              "13": ("CANCELLED", "None"), "14": ("RUNNING", "None"), "15": ("TIMEOUT", "")}
    jobs = {"slurm-0": "11", "slurm-1": "12", "slurm-2": "13", "slurm-3": "14",
            "slurm-4": "15", "slurm-5": "16"}
    assert timed_out(states, jobs) == ["slurm-0", "slurm-1", "slurm-4"]


def test_the_lost_worker_line_says_the_walltime_and_what_to_raise():
    limits = {"slurm-0": DEFAULT, "slurm-1": DEFAULT}
    assert walltime_note([], ["slurm-0"], limits, "slurm") == ("", "")
    assert walltime_note(["slurm-0", "slurm-1"], ["slurm-0", "slurm-1"], limits, "slurm") == (
        "their slurm jobs reached their walltime (cluster.jobqueue.walltime: 01:00:00)",
        "cluster.jobqueue.walltime")
    assert walltime_note(["slurm-1"], ["slurm-1"], limits, "slurm")[0] == (
        "its slurm job reached its walltime (cluster.jobqueue.walltime: 01:00:00)")
    assert walltime_note(["slurm-1"], ["slurm-0", "slurm-1"], limits, "slurm")[0] == (
        "slurm-1's slurm job reached its walltime (cluster.jobqueue.walltime: 01:00:00)")
    mixed = {"slurm-gpu-0": ("cluster.jobqueue.groups.0.walltime", "04:00:00"),
             "slurm-cpu-0": ("cluster.jobqueue.walltime", None)}
    assert walltime_note(["slurm-gpu-0", "slurm-cpu-0"], ["slurm-gpu-0", "slurm-cpu-0"],
                         mixed, "slurm") == (
        "their slurm jobs reached their walltime (cluster.jobqueue.groups.0.walltime: "
        "04:00:00, cluster.jobqueue.walltime unset: the queue's time limit)",
        "cluster.jobqueue.groups.0.walltime, cluster.jobqueue.walltime")


def test_the_runs_and_the_sweeps_last_line_say_to_raise_the_walltime():
    lost = WorkerLost("step 57: workers slurm-0, slurm-1 left the cluster: their slurm jobs "
                      "reached their walltime (cluster.jobqueue.walltime: 01:00:00); their "
                      "work in the run is lost", ["tls://a:1", "tls://b:1"],
                      ["slurm-0", "slurm-1"], walltime="cluster.jobqueue.walltime")
    final = lost.reworded(f"{lost}, and no worker of the run is left to continue on")
    assert final.walltime == "cluster.jobqueue.walltime" and final.labels == lost.labels
    assert lost_line(final) == (
        f"{final}; raise cluster.jobqueue.walltime for longer jobs, or start the run again "
        "with train.resume=true to continue from the last checkpoint (on fresh jobs)")
    # the sweep submits its own jobs again: "once the cluster is back" is for one by hand
    assert one_line(final).endswith("; raise cluster.jobqueue.walltime, or run the same "
                                    "sweep command again to rerun this point (once a "
                                    "cluster you started yourself is back)")
    plain = WorkerLost("step 3: worker slurm-0 left the cluster", ["tls://a:1"], ["slurm-0"])
    assert lost_line(plain).endswith("; start the run again with train.resume=true to "
                                     "continue from the last checkpoint")
    assert "walltime" not in one_line(plain)


def test_a_walltime_is_checked_as_it_loads_and_a_number_is_seconds():
    """`1h` went to sbatch, which refused it 12 s later (exit 1, no field named); and
    YAML reads `12:00:00` as a number (base 60): it was refused as no string. A
    walltime is now HH:MM:SS (Slurm's D-HH:MM:SS too) or seconds, written HH:MM:SS."""
    assert JobqueueConfig(walltime=43200).walltime == "12:00:00"
    assert JobqueueConfig(walltime=90).walltime == "00:01:30"
    assert JobGroupConfig(walltime="2-00:00:00").walltime == "2-00:00:00"
    assert JobqueueConfig(walltime="48:00:00").walltime == "48:00:00"
    for bad in ("1h", "1:60:00", "01:00", 0):
        with pytest.raises(FieldError, match="walltime"):
            JobqueueConfig(walltime=bad)
