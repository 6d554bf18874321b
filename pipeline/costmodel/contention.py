"""The client's share of the cores: what a step loses when the workers fill them.

An embedded cluster's scheduler runs in the client's process, on the same machine as
the workers. Every step costs that process CPU: the scheduler's work for each step
task (one per worker and step) and what it and the client do while time passes
(heartbeats, polls). Where a core is left free (one single-thread worker on two
cores), that work runs beside the step and costs it nothing. Where the workers'
threads fill every core, it runs in their place: a worker it displaces falls behind,
and since workers wait for each other at every exchange, the step waits with it.

Not all of it lands on the step: part runs while the workers wait for their next
task or for each other. The part that does, the *share*, and the client's CPU itself
are measured by the probe on the machine at hand (pipeline/probe/client_share.py;
docs/model.md, "The client's share of the cores"); `DEFAULT_CONTENTION_SHARE` stands
in only where the probe could not measure it. The measured twin is the critical
breakdown's ``wait``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The part of the client's CPU per step that delays the step when the workers fill
#: every core, where the probe did not measure it (a quiet 2-core Intel Xeon's,
#: docs/benchmarks.md).
DEFAULT_CONTENTION_SHARE = 0.3


@dataclass(frozen=True)
class ClientLoad:
    """The client process's CPU per step: ``per_task`` seconds per step task plus
    ``rate`` seconds per second of the step."""

    per_task: float
    rate: float

    def cpu_s(self, tasks: int, step_s: float) -> float:
        return self.per_task * tasks + self.rate * step_s


def cores_filled(worker_threads: list[int], cores: int) -> bool:
    """Whether the workers' threads leave the client no core of its own."""
    return cores > 0 and sum(worker_threads) >= cores


def contended_step(step_s: float, tasks: int, load: ClientLoad,
                   share: float = DEFAULT_CONTENTION_SHARE) -> float:
    """The step once `share` of the client's CPU over it delays it.

    The client's CPU grows with the step it delays (``rate``), so the step solves
    ``T' = T + share * (per_task * tasks + rate * T')``.
    """
    slowed = 1.0 - share * load.rate
    if slowed <= 0.0:
        raise ValueError(f"a client that needs {load.rate:.2f} of a core per second "
                         "cannot be modelled as delaying the step")
    return (step_s + share * load.per_task * tasks) / slowed
