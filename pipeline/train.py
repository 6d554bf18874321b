"""One training run from the command line:
``python -m pipeline.train CONFIG [--scheduler ADDR] [--fresh] [--check] [k=v ...]``.

Parses the command line, runs `pipeline.run.run_training` (which checks the config
and its paths before it starts: `--check` runs those checks alone) and prints the
closing summary; every failure is one line and an exit status (pipeline/cli.py); a
full disk's line says which store's disk, what was kept and how to go on. Ctrl-C,
SIGTERM and SIGHUP end the run cleanly with one line naming the last complete
checkpoint and the command that continues from it, and exit 128 + the signal's
number.

Run as a command, it reads its command line and config before it imports torch, Dask's
cluster code and xarray (`answer_before_imports`): `--help`, a mistyped option and a
config's wrong field are answered in half a second, not five.
"""

from __future__ import annotations

import os
import shlex
import sys

from pipeline.cli import (CONFIG_ERROR, IN_USE, RUNTIME_ERROR, Interrupted, OneLineParser,
                          UsageError, exit_with, fail, quiet_dask, quiet_start,
                          stops_on_signals)
with quiet_start():  # a Ctrl-C meanwhile is one line (pipeline.cli), as in the imports below
    from pipeline.config.run_config import RunConfig, load_run_config
    from pipeline.config.schema import ConfigError, load_yaml, parse_override

#: What `--help` says of the overrides a first run needs (docs/configuration.md has
#: every key).
RUN_KEYS_HELP = (
    "Overrides are dotted config keys, e.g. train.steps=30 or cluster.workers=3 "
    "(docs/configuration.md lists them all). name=NAME: the run's name (default: "
    "the config file's name); it names its output folder, so at most 100 letters, digits, "
    "'-', '_' and '.'. output=DIR: where the run writes its record, summary, trace and "
    "checkpoints (default: runs/<name>). progress=false: no progress bar or start-up "
    "lines.")


def parse_command(argv: list[str] | None) -> tuple[str, list[str], bool]:
    """The command line: the config file, its overrides (`--fresh` and `--scheduler`
    as theirs) and whether only to check. `--help` prints and exits; a wrong option
    raises `UsageError`."""
    parser = OneLineParser(prog="python -m pipeline.train",
                           description="Train a CNN with one strategy.",
                           epilog=RUN_KEYS_HELP)
    parser.add_argument("config", help="run config (YAML)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument("--scheduler", help="Dask scheduler address (default: embedded "
                        "cluster, or $DASK_SCHEDULER_ADDRESS)")
    parser.add_argument("--fresh", action="store_true", help="replace the results of an "
                        "earlier run in the output directory (train.fresh=true)")
    parser.add_argument("--check", action="store_true", help="check the config, its paths, "
                        "the dataset and files it names and the scheduler address, as "
                        "the run would before it starts, then exit without training")
    args = parser.parse_intermixed_args(argv)
    overrides = list(args.overrides)
    if args.fresh:
        overrides.append("train.fresh=true")
    if args.scheduler:
        overrides.append(f"cluster.scheduler={args.scheduler}")
    return args.config, overrides, args.check


def answer_before_imports(argv: list[str]) -> int | None:
    """The command's answer where its command line or config is wrong (exit 2, one
    line) or `--help` was asked (exit 0, by argparse), before the imports a run needs
    (torch, Dask's cluster code, xarray: 4-5 s of a command's start); None where both
    are fine, for `main` to read them again and go on. Only what `main` would answer
    the same way is answered here: anything else the config raises is left to it."""
    with quiet_start():
        try:
            path, overrides, _check = parse_command(argv)
            load_run_config(path, overrides)
        except (UsageError, ConfigError) as error:
            return fail(error, CONFIG_ERROR)
        except Exception:  # noqa: BLE001 - main meets it again and answers it
            return None
    return None


if __name__ == "__main__":
    answered = answer_before_imports(sys.argv[1:])
    if answered is not None:
        sys.exit(answered)

with quiet_start():  # torch, Dask, xarray: a Ctrl-C meanwhile is one line, not a traceback
    from pipeline.engine.checkpointing import CheckpointError
    from pipeline.cluster.connect import check_scheduler_answers
    from pipeline.cluster.workers import ClusterError, SchedulerLost, WorkerLost, scheduler_address
    from pipeline.training.outputs import (OutputLock, RunComplete, check_output_dir,
                                           earlier_kept, earlier_results)
    from pipeline.placement.split import PlacementError
    from pipeline.prediction import check_probe_environment
    from pipeline.preflight import check_before_start
    from pipeline.records.summary import format_summary
    from pipeline.run import run_training
    from pipeline.strategies import strategy_of
    from storage import checkpoints
    from storage.locks import LockBusy
    from storage.datasets.store import DatasetChanged, DatasetDamaged, DatasetError
    from storage.space import NoSpace


def load_checked(argv: list[str] | None) -> tuple[RunConfig, bool]:
    """Parse the command line and load the config (its fields checked as it loads);
    with `--check`, also check everything a run can find wrong before it starts
    (`check_before_start`), which the run otherwise checks itself, once. Returns the
    config and whether only to check."""
    path, overrides, check_only = parse_command(argv)
    config = load_run_config(path, overrides)
    check_worker_count(config, load_yaml(path), overrides)
    check_probe_environment()
    if check_only:
        check_before_start(config)
    return config, check_only


def check_worker_count(config: RunConfig, written: dict, overrides: list[str]) -> None:
    """What only the written config can tell from the defaults (`cluster.workers`
    defaults to a count of 2): a count written beside `cluster.devices`, which makes
    the workers itself (a count of 2 passed where any other was refused); and a count
    beside a scheduler you started, whose tagged workers the run trains on, all of
    them: the count was silently ignored (3 workers trained where
    `cluster.workers=2` was asked). Both refused naming the field, the second
    pointing to `cluster.use_workers`, as a list of workers is refused there
    (`preflight.check_external_workers`). A sweep gives a count axis that meaning
    itself."""
    count = (written.get("cluster") or {}).get("workers")
    for text in overrides:
        key, value = parse_override(text)
        if key == "cluster.workers":
            count = value
    if count is not None and config.cluster.devices is not None:
        raise ConfigError("cluster.devices: set either cluster.devices or cluster.workers")
    address = scheduler_address(config.cluster)
    if address is None or config.cluster.jobqueue is not None or \
            not strategy_of(config).uses_cluster:
        return
    if isinstance(count, int) and not isinstance(count, bool):
        raise ConfigError(f"cluster.workers: {count} counts the workers of the embedded "
                          f"cluster a run starts, but the run trains on the scheduler at "
                          f"{address}, on its workers offering the run's tags: to train on "
                          f"{count} of them, set cluster.use_workers={count} instead")


def resume_command(argv: list[str]) -> str:
    """The command that continues this run: the same command line without `--fresh`
    (or a train.fresh/train.resume override: fresh and resume together are refused),
    plus `train.resume=true`."""
    kept = [arg for arg in argv
            if not (arg.startswith("--f") and "--fresh".startswith(arg))
            and not arg.startswith(("train.fresh=", "train.resume="))]
    return shlex.join([sys.executable, "-m", "pipeline.train", *kept, "train.resume=true"])


def interrupted_line(stop: Interrupted, config: RunConfig | None, argv: list[str]) -> str:
    """What a stopped run says: the signal, its last complete checkpoint and the
    command that continues from there (steps since are done again)."""
    if config is None:
        return f"interrupted ({stop.name})"
    if stop.after_last_step:
        return (f"interrupted ({stop.name}) after the last step: the run is complete, its "
                f"record and summary are written ({config.output_dir}); nothing to continue")
    if earlier_kept(stop):
        return (f"interrupted ({stop.name}) before the first checkpoint; the earlier run's "
                f"results in {config.output_dir} are kept; run the same command again to "
                "start over")
    step = checkpoints.latest_complete_step(config.checkpoint_path)
    if step is None or (step == 0 and not earlier_results(config.output_dir)):
        # only the initial weights, which the seed makes again (a run stopped while it
        # connected or started its workers): the same command starts over, as the
        # resume would, and is not refused as an earlier run's results
        return (f"interrupted ({stop.name}) before the first checkpoint; run the same "
                "command again to start over")
    return (f"interrupted ({stop.name}): the last complete checkpoint is step {step} "
            f"({config.checkpoint_path}); continue from it with: {resume_command(argv)}")


#: The setting that moves a store of scratch or input data elsewhere (checkpoints stay
#: where the run can resume them: there, only freeing space helps).
STORE_SETTING = {"workspace": "workspace.path", "dataset store": "data.path"}


def no_space_line(error: NoSpace, config: RunConfig | None, argv: list[str]) -> str:
    """What a run stopped by a full disk says: which store's disk (and its path, which
    `NoSpace` says), what was kept, and how to go on once there is room."""
    setting = STORE_SETTING.get(error.store)
    room = f"free some space there (or set {setting} to a disk with more room)" if setting \
        else "free some space there"
    step = None if config is None else _complete_step(config.checkpoint_path)
    if config is not None and earlier_kept(error):
        return (f"{error}; nothing of this run was kept (the earlier run's results in "
                f"{config.output_dir} are); {room}, then run the same command again")
    if step is None:
        return f"{error}; no checkpoint was kept; {room}, then run the same command again"
    return (f"{error}; kept: every complete checkpoint, the last at step {step} "
            f"({config.checkpoint_path}); {room}, then continue from step {step} with: "
            f"{resume_command(argv)}")


def _complete_step(path: str) -> int | None:
    """The last complete checkpoint, or None (also when the store cannot be read)."""
    try:
        return checkpoints.latest_complete_step(path)
    except Exception:  # noqa: BLE001 - a store the full disk left half-made
        return None


def lost_line(error: WorkerLost | SchedulerLost, config: RunConfig | None = None) -> str:
    """What a run that lost its scheduler or workers beyond recovery says: how to go
    on. A worker lost at its memory limit would be lost again on a resume, so that
    line says what can help instead; a run that had trained nothing to keep (every
    worker lost while the work was placed, on a fresh run: only the initial weights,
    which the seed makes again) starts over with the same command. Batch jobs that
    ended at their walltime: the line names the field to raise as well."""
    if isinstance(error, WorkerLost) and error.memory:
        return (f"{error}; resuming would meet the same limit: give the worker more memory "
                "(dask worker --memory-limit), add workers, or lower train.batch")
    longer = getattr(error, "walltime", "")  # batch jobs ended at their walltime
    step = None if config is None else _complete_step(config.checkpoint_path)
    if config is not None and (earlier_kept(error) or (
            not step and not earlier_results(config.output_dir))):
        workers = " (on fresh workers)" if isinstance(error, WorkerLost) else ""
        raise_it = f"raise {longer} and " if longer else ""
        return (f"{error}; nothing was trained yet: {raise_it}run the same command again to "
                f"start over{workers}")
    if longer:
        return (f"{error}; raise {longer} for longer jobs, or start the run again with "
                "train.resume=true to continue from the last checkpoint (on fresh jobs)")
    return (f"{error}; start the run again with train.resume=true to continue from the "
            "last checkpoint")


def main(argv: list[str] | None = None) -> int:
    quiet_dask()
    argv = list(sys.argv[1:] if argv is None else argv)
    loaded: list[RunConfig] = []
    try:
        with stops_on_signals():
            return _main(argv, loaded)
    except Interrupted as stop:
        print(interrupted_line(stop, loaded[0] if loaded else None, argv), file=sys.stderr)
        return stop.status
    except KeyboardInterrupt:  # raised by hand, or with the signals left to Python
        print("interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str], loaded: list[RunConfig]) -> int:
    """Check, train and report; `loaded` receives the config once it is read."""
    try:
        config, check_only = load_checked(argv)
        loaded.append(config)
        if check_only:
            OutputLock(config.output_dir).check_free()  # as the run would refuse it
            check_output_dir(config)  # as the run would refuse its files
            if strategy_of(config).uses_cluster and not config.cluster.jobqueue:
                check_scheduler_answers(config.cluster)  # one it names: exit 1 as the run
            print(f"{config.name}: config and paths are fine ({config.strategy}, "
                  f"output {config.output_dir})")
            return 0
        result = run_training(config)  # checks before it starts
    except RunComplete as complete:
        print(complete)
        return 0
    except LockBusy as error:  # the output's lock (OutputBusy), or a dataset store's
        return fail(error, IN_USE)
    except NoSpace as error:
        return fail(no_space_line(error, loaded[0] if loaded else None, argv), RUNTIME_ERROR)
    except (WorkerLost, SchedulerLost) as error:
        return fail(lost_line(error, loaded[0] if loaded else None), RUNTIME_ERROR)
    except (ClusterError, FloatingPointError, DatasetDamaged, DatasetChanged,
            CheckpointError, OSError) as error:
        return fail(error, RUNTIME_ERROR)
    except (UsageError, ConfigError, DatasetError, PlacementError) as error:
        return fail(error, CONFIG_ERROR)
    embedded_scheduler = (strategy_of(config).uses_cluster  # `reference` has no scheduler
                          and scheduler_address(config.cluster) is None)
    print(format_summary(config.name, result.summary["strategy"], result.summary,
                         result.summary["workers"], embedded_scheduler=embedded_scheduler))
    print(f"  record      {os.path.join(result.output_dir, 'record.zarr')}")
    return 0


if __name__ == "__main__":
    exit_with(main())
