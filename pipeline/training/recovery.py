"""Surviving the loss of a worker (restore the last checkpoint, re-place, replay),
and using a worker that joins mid-run (re-place at the next checkpoint).

A distributed run keeps its state (shards, replicas, dense slices) in its workers'
memory, so a worker that dies takes its work with it. The only state that outlives
it is the last complete checkpoint, and batches are a pure function of (seed,
step): so the run closes the broken engine, asks the same placement as at the
start for a split over the surviving workers (`build_engine`, which placed the
first engine too), loads that checkpoint into a new engine and replays the steps
since. Replayed steps replace the lost ones in the record; every
recovery is kept as a `Recovery`. A run gives up (one `WorkerLost`) after
`train.max_recoveries`, so a crash loop ends. On a cluster the run did not start
itself, a worker offering the run's tags that joins is noticed at the next
checkpoint: the run stops there (nothing is in flight), places its work over the
larger set the same way and goes on from that checkpoint, replaying nothing (a
`Join`). A worker that stalled (stopped answering while holding the run's
tasks: pipeline/engine/stalls.py) is removed from the cluster before it is reported, and
is then recovered from like a dead one; its recovery says `cause: stalled`. Its
late writes can land only where the ended attempt wrote (storage/checkpoints.py):
each recovery names that attempt and counts what was found there. Stores
that stopped answering every worker (`StoreStalled`) end the run instead: the
message says which checkpoint is kept and how to go on once they answer.
"""

from __future__ import annotations

import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from distributed import Client

from pipeline.cluster.scheduler_guard import guarded
from pipeline.cluster.shared_paths import other_code
from pipeline.cluster.shared_use import SharedUseWatch
from pipeline.cluster.workers import (ClusterError, ClusterWorker, WorkerLost, current_workers,
                                      live_workers, scheduler_address)
from pipeline.config.run_config import RunConfig
from pipeline.engine.step_engine import StepEngine
from pipeline.training.loop import train_loop
from pipeline.records.record import RunRecorder
from pipeline.engine.stalls import StoreStalled
from pipeline.strategies import Strategy
from pipeline.records.trace import ClientEvent
from storage import checkpoints
from storage.liveness import answers
from tasks.specs import NetworkSpec


@dataclass
class Recovery:
    """One worker loss the run survived."""

    lost_at_step: int  # the first step whose result was lost
    restored_step: int  # the checkpoint the run went back to
    lost_workers: list[str]
    workers: list[str]  # the run's workers from then on
    split: dict[str, Any]  # the new split (as `split_of` gives it)
    replayed_steps: int  # steps done twice: restored_step .. lost_at_step - 1
    seconds: float  # from noticing the loss to the new engine's first step
    cause: str = "lost"  # "lost": left the cluster (died); "stalled": stopped answering
    # The ended attempt (its engine's run id): the only place the lost workers' late
    # writes can go (its workspace, removed; its checkpoint staging area, never
    # committed). `late_writes`: files found there once the run ended, discarded.
    ended_attempt: str = ""
    late_writes: int = 0


@dataclass
class Join:
    """Workers that joined mid-run, used from checkpoint `at_step` on."""

    at_step: int
    joined_workers: list[str]
    workers: list[str]  # the run's workers from then on
    split: dict[str, Any]
    seconds: float  # from the checkpoint to the new engine's first step


@dataclass
class History:
    """What happened to a run's workers: losses survived and workers joined."""

    recoveries: list[Recovery] = field(default_factory=list)
    joins: list[Join] = field(default_factory=list)

    def as_json(self) -> dict[str, list[dict[str, Any]]]:
        return {"recoveries": [asdict(r) for r in self.recoveries],
                "joins": [asdict(j) for j in self.joins]}


def joined(client: Client, config: RunConfig, offered: list[ClusterWorker],
           refused: set[str]) -> list[ClusterWorker]:
    """The run's workers if some joined since it was placed over `offered`, else []. A
    newcomer that runs other code than the run (`other_code`) is left out, said once
    and kept in `refused` (its address). Newcomers that do not say in time which code
    they run (busy, stopped, or the scheduler could not reach them) are left out this
    time, said, and asked again next time: the run goes on with its own workers rather
    than stop."""
    known = {s.address for s in offered}
    now = [s for s in current_workers(client, config.cluster) if s.address not in refused]
    new = [s for s in now if s.address not in known]
    try:
        other = other_code(client, new) if new else {}
    except ClusterError as error:
        names = ", ".join(s.name for s in new)
        print(f"warning: worker(s) {names} joined the cluster but did not say which code "
              f"they run ({error}); the run goes on without them for now",
              file=sys.stderr, flush=True)
        return []
    for address, why in other.items():
        name = next(s.name for s in new if s.address == address)
        print(f"warning: worker {name} ({address}) joined the cluster but {why}; the run "
              "goes on without it", file=sys.stderr, flush=True)
        refused.add(address)
    now = [s for s in now if s.address not in refused]
    return now if any(s.address not in known for s in now) else []


def build_engine(client: Client, config: RunConfig, strategy: Strategy, network: NetworkSpec,
                 train_samples: int, offered: list[ClusterWorker]) -> StepEngine:
    """The engine of `strategy` placed on `offered`: at the start of a run, and again
    after a recovery or a join."""
    plan = strategy.plan(client, config, network, offered, uuid.uuid4().hex[:8])
    return StepEngine(client, config, network, plan, train_samples)


def split_of(strategy: Strategy, engine: StepEngine) -> dict[str, Any]:
    """How an engine divides the work, as its strategy records it."""
    return strategy.split_of(engine.layout, engine.plan.placement)


def kept_checkpoints(config: RunConfig) -> str:
    """What a run its stores stopped keeps, and how to go on: the last complete
    checkpoint (not looked up when this process cannot list their store)."""
    path = config.checkpoint_path
    if not answers(path, 2.0):  # this process's own view (the workers' may be a mount)
        kept = f"the complete checkpoints in {path} are kept as they were"
    else:
        step = checkpoints.latest_complete_step(path)
        kept = (f"the last complete checkpoint, step {step}, is kept ({path})"
                if step is not None else f"no checkpoint is complete in {path}")
    return f"{kept}; once the store answers, start the run again with train.resume=true"


def survivors(client: Client, offered: list[ClusterWorker], lost: WorkerLost
              ) -> list[ClusterWorker]:
    """The run's workers still in the cluster (a loss may not come alone)."""
    alive = live_workers(client)
    return [s for s in offered if s.address in alive and s.address not in lost.addresses]


def train_with_recovery(config: RunConfig, client: Client, strategy: Strategy,
                        network: NetworkSpec, engine: StepEngine,
                        offered: list[ClusterWorker], recorder: RunRecorder,
                        client_events: list[ClientEvent], from_step: int,
                        train_samples: int, history: History | None = None,
                        shared_use: SharedUseWatch | None = None) -> History:
    """Train from `from_step` to the end with `engine`, recovering from lost workers
    and taking in joined ones.

    `offered` are the workers the run was placed over (a master that the strategy's
    placement adds is found again by it). Closes every engine it used. Returns what
    happened, in `history` where one is passed: the caller then has it even when the
    run is stopped (its record keeps the recoveries and joins so far). `shared_use`
    asks at each checkpoint whether other clients came to hold tasks meanwhile.
    """
    run = _Attempts(config, client, strategy, network, recorder, client_events,
                    train_samples, engine, offered, from_step, history or History(),
                    shared_use)
    try:
        while True:
            try:
                reached = run.train()
                if reached >= config.train.steps:
                    run.close()
                    count_late_writes(config, run.history.recoveries)
                    return run.history
                run.take_in_joined(reached)
            except StoreStalled as stalled:
                raise StoreStalled(f"{stalled}; {kept_checkpoints(config)}",
                                   stalled.paths) from None
            except WorkerLost as lost:
                run.recover_from(lost)
    finally:
        run.close()


class _Attempts:
    """The state `train_with_recovery` carries from one engine (attempt) to the next:
    the engine now running (None between attempts), the workers it was placed over, the
    step it starts from, and a recovery waiting for its engine to start (recorded once
    it has: its seconds run from the loss noticed to that start)."""

    def __init__(self, config: RunConfig, client: Client, strategy: Strategy,
                 network: NetworkSpec, recorder: RunRecorder,
                 client_events: list[ClientEvent], train_samples: int, engine: StepEngine,
                 offered: list[ClusterWorker], from_step: int, history: History,
                 shared_use: SharedUseWatch | None) -> None:
        self.config, self.client, self.strategy, self.network = config, client, strategy, network
        self.recorder, self.client_events, self.train_samples = (recorder, client_events,
                                                                 train_samples)
        self.current: StepEngine | None = engine
        self.offered, self.from_step = offered, from_step
        self.history = history
        self.grown: list[ClusterWorker] = []
        self.refused: set[str] = set()  # joined workers on other code
        self.pending: dict[str, Any] | None = None
        self.pending_since = 0.0
        self.shared_use = shared_use

    def _start(self) -> StepEngine:
        """The engine started at `from_step` (built over `offered` if there is none)."""
        if self.current is None:
            with guarded(self.client, self.config.cluster.scheduler_timeout,
                         f"step {self.from_step}: placing the work again"):
                self.current = build_engine(self.client, self.config, self.strategy,
                                            self.network, self.train_samples, self.offered)
        self.current.start(self.from_step)
        self.recorder.ensure_workers(self.current.workers, self.current.devices)
        return self.current

    def _stop_for_joined(self, step: int) -> bool:
        """Whether workers joined (`joined`): only a cluster the run did not start can
        grow, so only its scheduler is asked, under a guard (a thread, at each
        checkpoint); so is whether other clients came to hold tasks there."""
        if scheduler_address(self.config.cluster) is None:
            return False
        with guarded(self.client, self.config.cluster.scheduler_timeout,
                     f"step {step}: asking whether workers joined"):
            self.grown[:] = joined(self.client, self.config, self.offered, self.refused)
            if self.shared_use is not None:
                self.shared_use.check(f"at step {step}", only_new=True)
        return bool(self.grown)

    def train(self) -> int:
        """Start the engine and train until the end or a join; the step reached."""
        current = self._start()
        if self.pending is not None:
            self.history.recoveries.append(Recovery(
                **self.pending, workers=[w.name for w in current.workers],
                split=split_of(self.strategy, current),
                seconds=time.perf_counter() - self.pending_since))
            self.pending = None
        return train_loop(self.config, current, self.recorder, self.client_events,
                          self.from_step, self.train_samples, self._stop_for_joined)

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None

    def take_in_joined(self, reached: int) -> None:
        """Place the run again over its workers and those that joined, from `reached`."""
        since = time.perf_counter()
        self.close()
        new = [s.name for s in self.grown if s.address not in {x.address for x in self.offered}]
        self.offered, self.from_step = list(self.grown), reached
        self.client_events.append(ClientEvent(f"joined: {', '.join(new)} at step {reached}",
                                              time.time(), time.time()))
        current = self._start()
        self.history.joins.append(Join(reached, new, [w.name for w in current.workers],
                                       split_of(self.strategy, current),
                                       time.perf_counter() - since))

    def recover_from(self, lost: WorkerLost) -> None:
        """Go back to the last complete checkpoint over the survivors of `lost`, or raise
        when recoveries are used up or no worker is left."""
        noticed = time.perf_counter()
        recoveries, config = self.history.recoveries, self.config
        lost_at = max(self.recorder.steps, default=self.from_step - 1) + 1
        ended = self.current.run_id if self.current is not None else ""
        self.close()
        if len(recoveries) >= config.train.max_recoveries:
            raise lost.reworded(f"{lost} (recovered {len(recoveries)} time(s) already; "
                                f"train.max_recoveries={config.train.max_recoveries})"
                                if recoveries else str(lost)) from None
        if lost.stalled:
            print(f"warning: {lost}; recovering", file=sys.stderr)
        with guarded(self.client, config.cluster.scheduler_timeout,
                     f"recovering from {', '.join(lost.labels)}"):
            self.offered = survivors(self.client, self.offered, lost)
        if not self.offered:  # a WorkerLost: the run keeps its record and can resume
            raise lost.reworded(f"{lost}, and no worker of the run is left to continue "
                                "on") from None
        restored = checkpoints.latest_complete_step(config.checkpoint_path)
        assert restored is not None, "a run always has checkpoint 0"
        self.recorder.forget_from(restored)
        self.client_events.append(ClientEvent(
            f"recovery: lost {', '.join(lost.labels)}, back to step {restored}",
            time.time(), time.time()))
        self.pending = {"lost_at_step": lost_at, "restored_step": restored,
                        "lost_workers": list(lost.labels),
                        "cause": "stalled" if lost.stalled else "lost",
                        "replayed_steps": max(lost_at - restored, 0), "ended_attempt": ended}
        self.pending_since, self.from_step = noticed, restored


def count_late_writes(config: RunConfig, recoveries: list[Recovery]) -> None:
    """Discard what ended attempts' workers wrote into their checkpoint staging areas
    after the attempts ended (a fenced-off worker woken inside a save), counting it on
    each recovery (storage/checkpoints.py). Such writes never reach a checkpoint."""
    try:
        found = checkpoints.discard_attempts(config.checkpoint_path)
    except OSError:  # a store that failed: nothing there is read
        return
    for recovery in recoveries:
        recovery.late_writes = found.get(recovery.ended_attempt, 0)

