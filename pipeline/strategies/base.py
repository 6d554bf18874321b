"""What a training strategy is: one object that says everything specific to it.

The run, the engine, recovery, the sweep and the model never ask which strategy they
hold; they ask the strategy object (found by name in `pipeline.strategies.STRATEGIES`).
A strategy says:

- which configs it takes (`check`), and which placements; which networks it can
  share out over so many workers (`check_workers`);
- how it places its work on the run's workers (`plan`: the workers it uses, the
  split, and the `Layout` that says who computes what and which slices cross
  workers), and what its worker side is (`worker_side`, tasks/run_state.py);
- what it records of its split (`split_of`, `record_attrs`);
- (its layout says how checkpoints are chunked, `Layout.checkpoint_chunks`);
- its entry in the performance model (`model`, on described hardware), its
  prediction of a run on a probed cluster (`predict_run`), and where the model
  says it cannot run (`infeasible`);
- its memory per device (`memory_model`, `peak_memory`), what its split divides
  (`split_unit`: kernels of every conv layer, or samples of the batch), which of its
  rows must stay equal (`tied_rows`: the layers a residual sum ties) and how the
  split is read from a run's summary, from the model's step, or made even
  (`recorded_split`, `split_of_prediction`, `even_split`, `split_master`);
- how a sweep treats it (`one_worker`, `uses_cluster`), and whether the run
  replaces it by the model's choice (`chosen_by_model`, ``auto``).

A new strategy subclasses `Strategy`, fills these in, and registers an instance
(`pipeline.strategies.register`); tests/test_toy_strategy.py does so from a test
file alone.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

from distributed import Client

from pipeline.cluster.workers import ClusterWorker
from pipeline.config.run_config import RunConfig
from pipeline.engine.step_engine import RunPlan
from pipeline.costmodel import DeviceSpec, LinkSpec, Network, Options, Prediction, StoreSpec
from pipeline.costmodel.memory import DEFAULT_CONSTANTS, Footprint, MemoryConstants
from pipeline.placement.split import Placement, split_even
from pipeline.probe import ClusterProbe, MasterProbe
from pipeline.config.schema import ConfigError
from storage.datasets import DatasetError, open_dataset_info
from tasks.layout import Layout
from tasks.run_state import WorkerSide
from tasks.specs import Arithmetic, NetworkSpec

#: Every placement a run config can name (pipeline/placement/split_choice.py).
PLACEMENTS = ("calibrated", "even", "model", "recorded")


def network_for(config: RunConfig) -> NetworkSpec:
    """The run's network shapes (the dataset's image shape if it exists, else the
    config's: RGB images of `data.image_size`)."""
    try:
        shape = open_dataset_info(config.dataset_path).image_shape
    except DatasetError:
        side = config.data.image_side()
        shape = (3, side, side)
    return config.network_spec(shape)


class Strategy:
    """A training strategy: subclass it and fill in what differs (module doc)."""

    #: The name a config's ``strategy:`` gives.
    name: str = ""
    #: False for a strategy that trains in the client's process (``reference``).
    uses_cluster: bool = True
    #: True for a strategy that uses one worker whatever the cluster offers (``single``):
    #: a sweep measures it at the fewest workers only.
    one_worker: bool = False
    #: The placements it takes.
    placements: tuple[str, ...] = PLACEMENTS
    #: The summary key of its split (``placement: recorded`` reads it back).
    split_key: str = "kernel_split"
    #: What its tasks run on a worker.
    worker_side: WorkerSide | None = None
    #: True for ``auto``: the run replaces it, once its cluster is up, by the strategy
    #: the performance model predicts fastest (pipeline/strategies/auto.py).
    chosen_by_model: bool = False
    #: True where the memory count (pipeline/costmodel/memory.py) has a model of it
    #: (`peak_memory`); every memory check leaves a strategy without one out.
    memory_model: bool = False
    #: What its split divides: ``"kernel"`` (every conv layer's kernels, rows
    #: ``[layer][worker]``) or ``"sample"`` (the batch's samples, one row).
    split_unit: str = "kernel"
    #: The settings beyond plain SGD its arithmetic uses (of
    #: `pipeline.engine.checkpointing.SGD_VALUES`): a resume compares the rest as plain
    #: SGD has them, so a strategy that ignores a setting does not hide a change in
    #: it. None: every one as the config writes it (a strategy that does not say).
    arithmetic_settings: tuple[str, ...] | None = None

    def check(self, config: RunConfig) -> None:
        """Refuse, naming the field, a config this strategy cannot run."""
        if config.placement not in self.placements:
            raise ConfigError(f"placement: {config.placement!r} is not for strategy "
                              f"{self.name!r}, which takes "
                              f"{', '.join(repr(p) for p in self.placements)}")

    def check_workers(self, config: RunConfig, network: NetworkSpec, workers: int) -> None:
        """Refuse, naming the field, a network this strategy cannot share out over
        `workers` workers: asked before a placement times them (by `--check` too, for
        an embedded cluster), and of the workers a placement kept."""

    def plan(self, client: Client, config: RunConfig, network: NetworkSpec,
             offered: list[ClusterWorker], run_id: str) -> RunPlan:
        """Place the run's work on `offered` (the workers offering the run's tags)."""
        raise NotImplementedError(f"strategy {self.name!r} runs on no cluster")

    def make_plan(self, config: RunConfig, workers: list[ClusterWorker], layout: Layout,
                  placement: Placement) -> RunPlan:
        """The plan of `layout` on `workers`, with this strategy's worker side."""
        if self.worker_side is None:
            raise NotImplementedError(f"strategy {self.name!r} has no worker side")
        return RunPlan(workers, layout, placement, self.worker_side,
                    self.arithmetic(config, len(workers)))

    def arithmetic(self, config: RunConfig, workers: int) -> Arithmetic:
        """How its workers compute (SGD settings, the conv learning-rate factor)."""
        return Arithmetic(config.optimizer_spec(), 1.0, config.train.check_replicas,
                          config.train.seed, config.data.augmentation(config.train.seed))

    def split_of(self, layout: Layout, placement: Placement) -> dict[str, Any]:
        """Its split as the record and summary keep it, e.g. ``{"kernel_split": ...}``."""
        return {self.split_key: placement.counts}

    def record_attrs(self, config: RunConfig) -> dict[str, Any]:
        """Extra attributes of the run's record (settings only it has), as strings."""
        return {}

    def model(self, network: Network, batch: int, devices: Sequence[DeviceSpec],
              link: LinkSpec, store: StoreSpec | None, options: Options) -> Prediction:
        """The performance model's step for this strategy (pipeline/costmodel)."""
        raise NotImplementedError(f"strategy {self.name!r} has no performance model")

    def predict_run(self, config: RunConfig, probe: ClusterProbe | MasterProbe,
                    network: Network, split: dict[str, Any]) -> Prediction:
        """The model's step of a run of `config` on the probed cluster, as the engine
        would run it; `split` holds the run's recorded split (``kernel_split``,
        ``batch_split``: None for the one its placement would choose)."""
        raise NotImplementedError(f"strategy {self.name!r} has no run prediction")

    def workers_used(self, config: RunConfig, probe: ClusterProbe) -> int:
        """How many of the probed workers a run of `config` uses."""
        offered = len(probe.workers)
        if config.cluster.use_workers:
            offered = min(offered, config.cluster.use_workers)
        return self.devices_used(offered)

    @staticmethod
    def cluster_probe(probe: ClusterProbe | MasterProbe) -> ClusterProbe:
        """`probe`, which must be a cluster probe (distributed strategies)."""
        if not isinstance(probe, ClusterProbe):
            raise TypeError("a distributed strategy is predicted from a ClusterProbe")
        return probe

    def infeasible(self, batch: int, devices: int) -> str:
        """Why the model cannot place this strategy's step on `devices` ("" if it can)."""
        return ""

    def devices_used(self, devices: int) -> int:
        """How many of `devices` a step of this strategy uses."""
        return 1 if self.one_worker else devices

    def steps_per_task(self, config: RunConfig) -> int | Literal["auto"]:
        """Steps per Dask task of a run of `config` (`RunConfig.steps_per_task`)."""
        return config.steps_per_task()

    def peak_memory(self, network: Network, batch: int,
                    split: Sequence[Sequence[int]] | None = None, s: int = 4,
                    master: int | None = 0, constants: MemoryConstants = DEFAULT_CONSTANTS,
                    gpu: Sequence[bool] | None = None) -> Footprint:
        """Each device's predicted peak bytes under `split` (rows of `split_unit`; None:
        one device), `master` the device with the dense head, `gpu[d]` whether device d
        is a GPU (pipeline/costmodel/memory.py)."""
        raise ValueError(f"no memory model for strategy {self.name!r}")

    def even_split(self, config: RunConfig, network: NetworkSpec, devices: int
                   ) -> tuple[list[list[int]], list[int]]:
        """The even split of a run of `config` over `devices`, and its quanta (the units
        a split moves: a chunk of channels per conv layer, or one sample)."""
        if self.split_unit == "sample":
            return [split_even(config.train.batch, devices, 1)], [1]
        quanta = config.channel_quanta(network)
        return [split_even(layer.kernels, devices, q)
                for layer, q in zip(network.conv, quanta)], quanta

    def tied_rows(self, network: NetworkSpec) -> list[list[int]] | None:
        """The rows of its split that must stay equal, and move together when memory
        moves units (`pipeline.placement.memory_fit.move_to_fit`): the layers a
        residual sum ties (`NetworkSpec.tied_groups`) where the split is of kernels;
        None (every row alone) where it is of samples."""
        return network.tied_groups() if self.split_unit == "kernel" else None

    def recorded_split(self, summary: dict[str, Any]) -> list[list[int]] | None:
        """Its split as a run's summary keeps it (`split_key`), in rows; None if none."""
        split = summary.get(self.split_key)
        return [list(split)] if split and self.split_unit == "sample" else split

    def split_of_prediction(self, prediction: Prediction) -> list[list[int]] | None:
        """The split the model's step used (`model`'s prediction), in rows."""
        if self.split_unit == "sample":
            return [list(prediction.details["batch_shares"])]
        return prediction.kernel_counts

    def split_master(self, master: int | None) -> int | None:
        """The device that stays in the run with no share of the split: the master,
        which keeps the dense head, where the split is of kernels; None where a device
        given no samples holds nothing of the run."""
        return master if self.split_unit == "kernel" else None
