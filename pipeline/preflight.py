"""Checks of a run's paths and addresses before anything starts.

A cluster takes seconds to start and a dataset minutes to build; a typo in an
output path or a scheduler address should not wait for either, and should not
surface as a traceback from deep inside `os.makedirs` or the Dask client. These
checks read the file system only (a directory to be created is probed with a
temporary directory, removed at once), so `--check` and `--dry-run` can run them
without side effects.
"""

from __future__ import annotations

import json
import os
import tempfile

from pipeline.config.addresses import address_problem
from pipeline.cluster.workers import scheduler_address, started_elsewhere, tagged_workers
from pipeline.config.run_config import RunConfig
from pipeline.cluster.connect import device_problem
from pipeline.cluster.links import link_problem
from pipeline.cluster.object_store import object_store_problem
from pipeline.cluster.jobqueue import jobqueue_problem
from pipeline.engine.checkpointing import check_resumed_run
from pipeline.engine.dataset import check_data_source, check_dataset_fits, expected_dataset
from pipeline.placement.split_choice import (check_recorded_split, recorded_counts,
                                             recorded_summary)
from pipeline.preflight_memory import check_embedded_memory
from pipeline.config.schema import ConfigError
from pipeline.cluster.security import tls_problem
from pipeline.strategies import Strategy, arithmetic_settings, strategy_of
from pipeline.strategies.base import network_for
from storage.datasets.writer import is_replaceable, why_not_replaceable
from storage.private import (default_workspace_root, folder_problem, owner_problem,
                             parent_problem)
from tasks.specs import NetworkSpec, batch_norm_name, batch_norm_rows, lone_batch_norm

SCHEDULER_VARIABLE = "DASK_SCHEDULER_ADDRESS"
#: The files at the root of a Zarr store (format 3, format 2).
ZARR_MARKERS = ("zarr.json", ".zgroup")


def check_writable_dir(path: str, field: str) -> None:
    """Raise ConfigError naming `field` unless `path` is, or can be made, a directory
    this process can write in.

    The nearest existing ancestor must be a directory, and a directory must be
    creatable in it: `os.access` would not do, because it says yes to root even on
    read-only mounts and on /proc.
    """
    target = os.path.abspath(path)
    existing = target
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = "is not a directory" if existing == target else f"is inside {existing}, a file"
        raise ConfigError(f"{field}: {path} {what}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".hetcnn-check-", dir=existing))
    except OSError as error:
        place = "" if existing == target else f" (in {existing})"
        raise ConfigError(f"{field}: cannot write to {path}{place}: "
                          f"{error.strerror or error}") from None


def check_own_dir(path: str, field: str) -> None:
    """Raise ConfigError naming `field` if `path` exists and belongs to another user
    (`storage.private.owner_problem`: made first by them, where the run would write)."""
    problem = owner_problem(os.path.abspath(path))
    if problem:
        raise ConfigError(f"{field}: {problem}: another user's folder could hand the run "
                          "files of theirs or change its results; choose another path")


def check_not_filesystem_root(path: str, field: str) -> None:
    """Raise ConfigError naming `field` if `path` is a filesystem root: a run writes its
    files straight into its output directory (and `--fresh` removes them there), so
    `output=/` would spread them over the root (root may write there)."""
    folder = os.path.abspath(path)
    if os.path.dirname(folder) == folder:
        raise ConfigError(f"{field}: {path} is the filesystem root; a run writes its files "
                          "(run.lock, record.zarr, checkpoints.zarr, workspace-*.zarr) "
                          "straight into its output directory: give it a folder of its own")


def check_outside_stores(path: str, field: str) -> None:
    """Raise ConfigError naming `field` if `path` is, or is inside, a Zarr store (a
    sweep's results, a dataset): a run's files there would be read as its damage."""
    folder = os.path.abspath(path)
    while True:
        if any(_zarr_metadata(os.path.join(folder, marker)) for marker in ZARR_MARKERS):
            where = "is" if folder == os.path.abspath(path) else "is inside"
            raise ConfigError(f"{field}: {path} {where} the Zarr store {folder}, not a run "
                              "directory; choose another output")
        parent = os.path.dirname(folder)
        if parent == folder:
            return
        folder = parent


def _zarr_metadata(path: str) -> bool:
    """Whether `path` is a Zarr metadata file (JSON naming its `zarr_format`), not any
    file of that name."""
    try:
        with open(path, encoding="utf-8") as handle:
            return "zarr_format" in json.load(handle)  # a sweep store's: 75 KB and more
    except (OSError, ValueError, TypeError):
        return False


def check_dataset(config: RunConfig) -> None:
    """The dataset store opens, or can be built where the config says from a source
    that exists (the store may outlive the archive it was imported from), and the
    source takes the config's image size and classes."""
    check_data_source(config)
    path = config.dataset_path
    field = "data.path"
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise ConfigError(f"{field}: {path} is a file, not a dataset store")
        if not is_replaceable(path):  # the run would refuse to build over it
            raise ConfigError(f"{field}: {path} exists and {why_not_replaceable(path)}: "
                              "name another path, or a dataset store")
        return  # a store of other arguments is rebuilt in its place
    source = config.data.source
    if source != "synthetic" and not os.path.exists(source):
        raise ConfigError(f"data.source: {source} does not exist (expected 'synthetic', a "
                          "folder of images, or CIFAR-10's cifar-10-python.tar.gz or its "
                          "extracted folder)")
    check_writable_dir(path, field)


def check_split_source(config: RunConfig, strategy: Strategy, network: NetworkSpec,
                       names: list[str] | None = None) -> None:
    """`placement: recorded`'s split, as far as files alone tell, in the placement's own
    words (`check_recorded_split`): `split_from`'s run summary can be read and records
    the split the strategy reuses; the split, given or recorded, has a row per conv
    layer (or the batch's), no negative count, and each row adds up to its layer's
    kernels (the batch); with `names` (the run's workers, where the config fixes them:
    an embedded cluster's) it has a count per worker, and a recorded one gives work to
    none the run lacks. `auto` reads it only if the model picks a strategy that takes
    it (on the cluster), and `reference` never: left out."""
    source = config.split_from
    if (config.placement != "recorded" or not strategy.uses_cluster
            or strategy.chosen_by_model or source is None):
        return
    key = strategy.split_key
    if isinstance(source, str) and names is not None:
        counts = recorded_counts(config, names, key)
    elif isinstance(source, str):
        summary = recorded_summary(source, key)[1]
        counts = summary[key] if key == "kernel_split" else [summary[key]]
    else:
        counts = [list(row) for row in source]
    if key in ("kernel_split", "batch_split"):
        check_recorded_split(config, network, key, counts,
                             None if names is None else len(names))


def embedded_workers(config: RunConfig, strategy: Strategy) -> list[str] | None:
    """The names of the workers an embedded cluster gives the run's split (the
    tagged ones, `use_workers` of them; a strategy of one worker, its master: one
    name, unknown and so None); None where the cluster is not the config's."""
    cluster = config.cluster
    if started_elsewhere(cluster) or strategy.one_worker:
        return None
    offering = tagged_workers({w.name: {"name": w.name, "resources": w.resources}
                               for w in cluster.worker_list()}, cluster.tags())
    return [name for name, _, _ in offering][:cluster.use_workers or None]


def check_scheduler_variable() -> None:
    """$DASK_SCHEDULER_ADDRESS, when it is what names the scheduler, has an address's form."""
    address = os.environ.get(SCHEDULER_VARIABLE)
    problem = address_problem(address) if address else None
    if problem:
        raise ConfigError(f"{SCHEDULER_VARIABLE}: {problem}")


def check_external_workers(config: RunConfig) -> None:
    """A run on a scheduler you started trains on that scheduler's workers as they are:
    a `cluster.workers` list (names, emulated speeds, threads, devices, memory limits)
    or `cluster.devices` describes the embedded cluster a run starts, and with a
    scheduler none of it would apply. Refused (ConfigError naming the field) rather
    than run on other workers than the config says: a worker listed at `speed: 0.5`
    trained at full speed, and every worker of the scheduler joined in. With
    `cluster.link` the run starts its own (linked) cluster whatever
    $DASK_SCHEDULER_ADDRESS says (`scheduler_address`): its list is that cluster's."""
    cluster = config.cluster
    if scheduler_address(cluster) is None:
        return
    source = "cluster.scheduler" if cluster.scheduler else SCHEDULER_VARIABLE
    field = ("devices" if cluster.devices is not None
             else "workers" if isinstance(cluster.workers, list) else None)
    if field is None:
        return
    raise ConfigError(f"cluster.{field}: lists the workers of the embedded cluster a run "
                      "starts (names, emulated speeds, threads, devices, memory limits), but "
                      f"{source} names a scheduler you started, whose workers the run would "
                      "train on as they are: drop the list (choose its workers with "
                      f"cluster.resource and cluster.use_workers) or unset {source}")


def check_batch_rows(config: RunConfig, network: NetworkSpec) -> None:
    """The whole batch gives every batch norm more than one value per channel
    (`tasks.specs.lone_batch_norm`), else a ConfigError naming ``train.batch`` and the
    layer.

    Why the whole batch, for every strategy: `reference`, `single` and `kernel`
    normalise over it, and so do `data` and `hybrid` replicas with synchronised batch
    norm; with ``train.batch_norm: local`` each replica normalises over its own rows,
    and the batch split keeps those at none or at least `batch_norm_rows`
    (pipeline/placement/split.py, `merge_short_shares`), which a batch this small
    cannot give any replica either. Without the check PyTorch fails inside the first
    step, a traceback from the process or from every worker."""
    batch = config.train.batch
    layer = lone_batch_norm(network, batch)
    if layer is not None:
        raise ConfigError(f"train.batch: a batch of {batch} gives "
                          f"{batch_norm_name(network, layer)} one value per channel, "
                          "which batch norm cannot normalise in training: use "
                          f"train.batch >= {batch_norm_rows(network)}")


def check_run(config: RunConfig, output_field: str = "output") -> Strategy:
    """Everything about one run that can be checked without starting it: its strategy
    takes the config (returned), every path and address it names can be had, and what
    files alone say fits it (the dataset's classes and samples, the checkpoints a
    resume continues, the summary `split_from` names). The run makes these checks
    again where they meet the real thing, in the same words."""
    strategy = strategy_of(config)
    check_not_filesystem_root(config.output_dir, output_field)
    check_writable_dir(config.output_dir, output_field)
    check_own_dir(config.output_dir, output_field)
    check_outside_stores(config.output_dir, output_field)
    check_dataset(config)
    check_dataset_fits(config, *expected_dataset(config))  # its classes, a batch's samples
    network = network_for(config)  # the network fits the images (ConfigError naming the layer)
    check_batch_rows(config, network)
    check_resumed_run(config, network, arithmetic_settings)
    check_split_source(config, strategy, network)
    workspace = config.workspace.path
    if workspace and "://" not in workspace:
        check_writable_dir(workspace, "workspace.path")
        problem = parent_problem(config.workspace.folder())
        if problem:
            raise ConfigError(f"workspace.path: {problem}: another user could move the run's "
                              "workspace aside and feed its workers activations of theirs; "
                              "choose a folder of your own")
    problem = None if workspace else folder_problem(default_workspace_root())
    if strategy.uses_cluster and problem:
        raise ConfigError(f"workspace.path: the default workspace folder {problem}: remove "
                          "it, or set workspace.path to a folder of your own")
    if strategy.uses_cluster and not config.cluster.scheduler:
        check_scheduler_variable()
    if strategy.uses_cluster:
        check_external_workers(config)
    problem = tls_problem(scheduler_address(config.cluster), config.cluster.tls)
    if strategy.uses_cluster and problem:
        raise ConfigError(problem)
    problem = link_problem() if config.cluster.link_rates() is not None else None
    if strategy.uses_cluster and problem:
        raise ConfigError(f"cluster.link: {problem}")
    problem = object_store_problem() if config.cluster.workspace_transport() == "s3" else None
    if strategy.uses_cluster and problem:
        raise ConfigError(f"cluster.link.workspace: {problem}")
    problem = jobqueue_problem(config.cluster) if strategy.uses_cluster else None
    if problem:
        raise ConfigError(problem)
    return strategy


def check_before_start(config: RunConfig, output_field: str = "output") -> Strategy:
    """Everything a run that starts its own cluster can check before it starts:
    `check_run` (the strategy, returned), then, for a strategy that uses a cluster,
    the embedded workers (tags, devices, master) and memory.
    `pipeline.run.run_training` runs it once per run; `python -m pipeline.train
    --check` runs it alone, and a sweep for each of its measured points."""
    strategy = check_run(config, output_field)
    if strategy.uses_cluster:
        check_embedded_workers(config)
        names = embedded_workers(config, strategy)
        check_split_source(config, strategy, network_for(config), names)
        if names is not None and config.placement != "recorded":
            strategy.check_workers(config, network_for(config), len(names))
        check_embedded_memory(config)
    return strategy


def check_embedded_workers(config: RunConfig) -> None:
    """A run on its own embedded cluster knows every worker: one that asks for a tag
    none of them offers (or more of them than there are), a worker on a CUDA device
    this machine lacks, or a `cluster.master` that is none of them nor their tags is
    a config mistake, named at once rather than after `cluster.wait_timeout` or once
    the cluster has started (`pipeline.cluster.workers.add_master`)."""
    cluster = config.cluster
    if started_elsewhere(cluster):
        return
    workers = cluster.worker_list()
    tags = cluster.tags()
    offering = tagged_workers({w.name: {"name": w.name, "resources": w.resources}
                               for w in workers}, tags)
    problem = device_problem(workers)  # first: a worker's tag follows its device
    if problem:
        raise ConfigError(f"{'cluster.devices' if cluster.devices else 'cluster.workers'}: "
                          f"{problem}")
    field = "cluster.resources" if cluster.resources else "cluster.resource"
    if not offering:
        offered = ", ".join(sorted({t for w in workers for t in (w.resources or {})}))
        wanted = "' or '".join(tags)
        raise ConfigError(f"{field}: no worker of the embedded cluster offers '{wanted}' "
                          f"(they offer: {offered})")
    if cluster.use_workers and cluster.use_workers > len(offering):
        raise ConfigError(f"cluster.use_workers: {cluster.use_workers}, but only "
                          f"{len(offering)} worker(s) of the embedded cluster offer "
                          f"{' or '.join(tags)}")
    master = cluster.master
    if master is not None and not any(w.name == master or (w.resources or {}).get(master, 0)
                                      >= 1 for w in workers):
        raise ConfigError(f"cluster.master: no worker of the embedded cluster is named or "
                          f"tagged '{master}' (workers: {', '.join(w.name for w in workers)})")
