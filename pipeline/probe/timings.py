"""One shard's and one replica trunk's measured times, and how they move to their
steps' quartiles.

Apart from the probe's results (results.py) because the probe's rounds, readings
and the cost model's tables (tables.py) all handle single timings, below the
cluster-wide record that gathers them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


def quartile_factor(total: float, low: float, high: float, bound: str) -> float:
    """What to scale a timing of `total` seconds by to put it at its steps' lower
    (``bound="low"``) or upper (``"high"``) quartile: never past the median's side,
    1.0 for ``"mid"`` or where no spread was kept."""
    edge = low if bound == "low" else high
    if bound == "mid" or edge <= 0 or total <= 0:
        return 1.0
    return min(edge / total, 1.0) if bound == "low" else max(edge / total, 1.0)


@dataclass
class ShardTiming:
    """One measured shard: ``kernels`` of ``layer`` while ``active`` workers ran at once.

    ``input_grad_s`` is the first part of ``backward_s``: pool/ReLU backward and the
    input gradient, which the engine hands on before the weight gradient. Each is the
    median of the rounds' step medians (`pipeline.probe.robust`); ``low_s`` and
    ``high_s`` are the quartiles of forward + backward over every step timed (0: not
    kept, as in a reference probe), ``rounds`` and ``steps`` what they come from.
    ``settled``: two rounds agreed with the figure (or one round was all there was);
    ``outlier``: it breaks "time grows with kernels, at most in proportion" against the
    worker's other sizes even after being timed again, so the model's tables leave it
    out. ``dataset_s`` (first layer only): the batch read before the forward, figured
    like the passes (``None``: another layer, or not measured).
    """

    layer: int
    kernels: int
    active: int
    forward_s: float
    backward_s: float
    input_grad_s: float = 0.0
    rounds: int = 1
    steps: int = 1
    low_s: float = 0.0
    high_s: float = 0.0
    settled: bool = True
    outlier: bool = False
    dataset_s: float | None = None

    def scaled(self, bound: str) -> "ShardTiming":
        """This timing at the lower (``"low"``) or upper (``"high"``) quartile of its
        steps: every pass scaled alike; itself where no spread was kept."""
        f = quartile_factor(self.forward_s + self.backward_s, self.low_s, self.high_s, bound)
        return replace(self, forward_s=self.forward_s * f, backward_s=self.backward_s * f,
                       input_grad_s=self.input_grad_s * f)


@dataclass
class TrunkTiming:
    """The whole conv trunk as a ``data``/``hybrid`` replica runs it on this worker:
    ``rows`` samples, ``active`` workers' replicas running at once. Figures, spread
    and ``settled`` as in :class:`ShardTiming` (forward + backward for the spread);
    ``dataset_s`` the replica's batch read; ``dense_s`` the dense head's forward and
    backward on the same rows, every replica at once (replica_rates.py; None: not
    measured); ``data_step_s`` a ``data`` replica's whole replica-step on the same rows
    (trunk and head, forward and backward, its gradient's hand-on copies; the data
    replica plan's, pipeline/probe/runs.py: None where it did not run); ``update_s`` that
    replica's update (its grad-update: the summed ranges gathered into one flat
    gradient and the SGD step over every parameter, at the probe's SGD, the config's
    defaults; None where the data replica plan did not run); ``hybrid_head_s`` the
    ``hybrid`` replica plan's dense ops on this worker (every dense-forward and
    dense-backward of its neurons, on the whole batch: scheme a), as a run runs them
    (None where that plan did not run or the network has no dense layer)."""

    rows: int
    active: int
    forward_s: float
    backward_s: float
    rounds: int = 1
    steps: int = 1
    low_s: float = 0.0
    high_s: float = 0.0
    settled: bool = True
    dataset_s: float | None = None
    dense_s: float | None = None
    data_step_s: float | None = None
    update_s: float | None = None
    hybrid_head_s: float | None = None

    def scaled(self, bound: str) -> "TrunkTiming":
        """At the lower or upper quartile of its steps (see `ShardTiming.scaled`; the
        data step by the trunk's spread)."""
        f = quartile_factor(self.forward_s + self.backward_s, self.low_s, self.high_s, bound)
        data_step = None if self.data_step_s is None else self.data_step_s * f
        return replace(self, forward_s=self.forward_s * f, backward_s=self.backward_s * f,
                       data_step_s=data_step)
