"""The replicas' exchanges through the workspace, as the engine runs them (replicas.py
drives them on a timeline: op by op, timeline.py, or a phase of all devices at a
time, timeline_fast.py).

The flat gradient's reduction (tasks/replica_layout.py, ``grads/<d>/<e>`` and
``reduced/<e>``): each device writes every other device's range of its gradient
(`hand_on`), reads and sums its own range, writes the sum, reads every other sum and
updates (`reduce_ops`, `reduce_phases`).

Synchronised batch norm (``train.batch_norm: sync``, tasks/sync_batch_norm.py): the
op that runs a replica's batch-norm layers stops at each one, forward and backward;
the replica writes its partial sums over its rows to a slot of its own and reads
every other replica's before it goes on (``batch_norm_slots``):

- ``bn-fwd/<l>/<d>``, after layer ``l``'s convolution: per channel the count, the sum
  and the sum of squared deviations, 3 values;
- ``bn-bwd/<l>/<d>``, in layer ``l``'s backward: per channel the sums of dy and of
  dy * (x - mean), 2 values.

So an op's compute is cut into stretches (`stretches`), one before each exchange and
one after the last, and every replica takes part in every exchange (one with no rows
too: `exchange_ops`, `exchange_phases`). The model places an exchange after its
layer's whole forward and before its whole backward: in the engine a layer's
convolution, most of its time, sits on the other side of the exchange, which only
moves time from one stretch to the next. Under ``local``, or with one replica, there
is no exchange and an op is one stretch, summed as it always was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from .compute import LayerTime, sum_accesses
from .network import Network
from .timeline import Timeline
from .timeline_fast import FastTimeline, Sources

__all__ = ["even_counts", "hand_on", "reduce_ops", "reduce_phases", "Exchange", "Stretches",
           "norm_slots", "stretches", "exchange_ops", "exchange_phases"]


def even_counts(total: int, parts: int) -> list[int]:
    """`total` into `parts` counts as equal as can be, the larger ones first (as
    tasks.replica_layout.split_counts: the cost model imports nothing of the engine;
    tests/test_costmodel.py checks the two agree through the bytes they move)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def hand_on(tl: Timeline, d: int, devices: int, length: float, s: int, tag: str) -> None:
    """Device `d` writes every other device's range of its flat gradient of `length`."""
    owned = [n * s for n in even_counts(int(length), devices)]
    for e in range(devices):
        if e != d:
            tl.write(d, f"{tag}/{d}/{e}", owned[e])


def reduce_ops(tl: Timeline, devices: int, length: float, s: int, update: dict[int, float],
               stream: dict[int, float], tag: str) -> None:
    """The reduce-scatter by range ownership and the all-gather of a flat gradient of
    `length` values, each device having written its ranges before (`hand_on`)."""
    owned = [n * s for n in even_counts(int(length), devices)]
    for e in range(devices):
        tl.read(e, [(f"{tag}/{d}/{e}", owned[e]) for d in range(devices) if d != e])
        tl.run(e, "compute", stream[e] * sum_accesses(devices) * owned[e] / s)
        if devices > 1:
            tl.write(e, f"{tag}-sum/{e}", owned[e])
    for d in range(devices):
        tl.read(d, [(f"{tag}-sum/{e}", owned[e]) for e in range(devices) if e != d])
        tl.run(d, "compute", update[d])


def reduce_phases(tl: FastTimeline, length: float, s: int, update: dict[int, float],
                  stream: dict[int, float]) -> None:
    """`hand_on` and `reduce_ops` for all devices at once: every device writes the
    others' ranges in turn, reads and sums its own, writes the sum, reads the others'."""
    p = tl.devices
    everyone = np.arange(p)
    owned = np.array(even_counts(int(length), p), dtype=float) * s
    grads = tl.write_in_turn(everyone, everyone, owned, 1)
    tl.read_in_turn(everyone, grads, owned, 1)
    tl.run(everyone, "compute", np.array([stream[e] for e in range(p)]) * sum_accesses(p) * owned / s)
    if p > 1:
        sums = tl.write_each(everyone, owned, 1)
        tl.read(everyone, Sources(everyone, sums, owned), 1, np.zeros(p), np.zeros(p))
    tl.run(everyone, "compute", np.array([update[d] for d in range(p)]))


#: The slots' names and values per channel, as tasks/replica_layout.py's.
FORWARD_SLOT, FORWARD_VALUES = "bn-fwd", 3
BACKWARD_SLOT, BACKWARD_VALUES = "bn-bwd", 2


@dataclass(frozen=True)
class Exchange:
    """One exchange: every device writes ``nbytes`` to ``<slot>/<device>`` and reads
    every other device's."""

    slot: str  # "bn-fwd/<l>" or "bn-bwd/<l>"
    nbytes: float


def norm_slots(network: Network, devices: int, s: int, batch_norm: str
               ) -> tuple[dict[int, Exchange], dict[int, Exchange]]:
    """The exchanges after conv layer ``l``'s forward and before its backward, by
    ``l``: none under ``local`` or with one device."""
    if batch_norm == "local" or devices <= 1:
        return {}, {}
    normed = [(l, c.out_channels * s) for l, c in enumerate(network.conv) if c.batch_norm]
    return ({l: Exchange(f"{FORWARD_SLOT}/{l}", FORWARD_VALUES * row) for l, row in normed},
            {l: Exchange(f"{BACKWARD_SLOT}/{l}", BACKWARD_VALUES * row) for l, row in normed})


@dataclass(frozen=True)
class Stretches:
    """Each device's compute in one op, cut at its exchanges: ``seconds[i]`` (a value
    per device) runs before ``exchanges[i]``; ``last``, after the last one."""

    seconds: list[np.ndarray]
    exchanges: list[Exchange]

    @property
    def last(self) -> np.ndarray:
        return self.seconds[-1]


def stretches(times: list[list[LayerTime]], after_forward: Mapping[int, Exchange] | None,
              before_backward: Mapping[int, Exchange] | None) -> Stretches:
    """The compute of an op that runs the forward (``after_forward`` not None), the
    backward (``before_backward`` not None) or both of replicas timed ``times[d][i]``
    (device ``d``, layer ``i`` in forward order). Equal devices share one row
    (`replica_times`), cut once."""
    index: dict[int, int] = {}
    cuts: list[list[float]] = []
    exchanges: list[Exchange] = []
    for row in times:
        if id(row) not in index:
            index[id(row)] = len(cuts)
            seconds, exchanges = _cut(row, after_forward, before_backward)
            cuts.append(seconds)
    matrix = np.array(cuts, dtype=float)[[index[id(row)] for row in times]]
    return Stretches(list(matrix.T), exchanges)


def _cut(row: list[LayerTime], after_forward: Mapping[int, Exchange] | None,
         before_backward: Mapping[int, Exchange] | None) -> tuple[list[float], list[Exchange]]:
    """One replica's stretches and the exchanges between them."""
    forward, backward = after_forward is not None, before_backward is not None
    if not after_forward and not before_backward:  # one stretch, summed as ever
        if forward and backward:
            return [sum(t.forward + t.backward for t in row)], []
        return [sum(t.forward if forward else t.backward for t in row)], []
    seconds: list[float] = []
    exchanges: list[Exchange] = []
    clock = 0.0
    if after_forward is not None:
        for i, t in enumerate(row):
            clock += t.forward
            if i in after_forward:
                seconds.append(clock)
                exchanges.append(after_forward[i])
                clock = 0.0
    if before_backward is not None:
        for i in reversed(range(len(row))):
            if i in before_backward:
                seconds.append(clock)
                exchanges.append(before_backward[i])
                clock = 0.0
            clock += row[i].backward
    return [*seconds, clock], exchanges


def exchange_ops(tl: Timeline, cut: Stretches) -> None:
    """The stretches up to the last exchange, op by op: at each exchange every device
    computes its stretch and writes its slot, then reads every other device's."""
    devices = range(len(tl.links))
    for seconds, exchange in zip(cut.seconds, cut.exchanges):
        for d in devices:
            tl.run(d, "compute", float(seconds[d]))
            tl.write(d, f"{exchange.slot}/{d}", exchange.nbytes)
        for d in devices:
            tl.read(d, [(f"{exchange.slot}/{e}", exchange.nbytes) for e in devices if e != d])


def exchange_phases(tl: FastTimeline, cut: Stretches) -> None:
    """`exchange_ops` for all devices at once (timeline_fast.py)."""
    everyone, none = np.arange(tl.devices), np.zeros(tl.devices)
    for seconds, exchange in zip(cut.seconds, cut.exchanges):
        tl.run(everyone, "compute", seconds)
        nbytes = np.full(tl.devices, float(exchange.nbytes))
        ready = tl.write_each(everyone, nbytes, 1)
        tl.read(everyone, Sources(everyone, ready, nbytes), 1, none, none)
