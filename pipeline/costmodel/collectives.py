"""Closed-form costs of collectives (Thakur, Rabenseifner & Gropp 2005; Chan et al. 2007).

All functions take ``n`` in bytes, the process count ``p`` and a
:class:`~pipeline.costmodel.devices.LinkSpec`; they return seconds and cost
zero for ``p <= 1`` or ``n <= 0``.  Meaning of ``n``:

- allreduce, reduce-scatter, reduce: the full vector each process holds;
- allgather: the gathered result (each process contributes ``n / p``);
- broadcast: the message;
- all-to-all: each process's send buffer (``n / p`` to every process).

Non-power-of-two ``p`` uses ``ceil(log2 p)`` rounds for the tree algorithms,
which is what the textbook forms reduce to for the common fix-ups.
"""

from __future__ import annotations

import math

from .devices import LinkSpec

__all__ = [
    "ring_allreduce",
    "rhd_allreduce",
    "allreduce",
    "recursive_doubling_allreduce",
    "fastest_allreduce",
    "ring_allgather",
    "ring_reduce_scatter",
    "binomial_broadcast",
    "linear_broadcast",
    "binomial_reduce",
    "linear_reduce",
    "broadcast",
    "reduce",
    "alltoall",
]


def _trivial(n: float, p: int) -> bool:
    return p <= 1 or n <= 0


def _log2(p: int) -> int:
    return math.ceil(math.log2(p))


def ring_allreduce(n: float, p: int, link: LinkSpec) -> float:
    """Ring: ``2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma``."""
    if _trivial(n, p):
        return 0.0
    f = (p - 1) / p
    return 2 * (p - 1) * link.alpha + 2 * f * n * link.beta + f * n * link.gamma


def rhd_allreduce(n: float, p: int, link: LinkSpec) -> float:
    """Recursive halving-doubling (Rabenseifner): ``2 log2(p) alpha + 2(p-1)/p n beta + (p-1)/p n gamma``."""
    if _trivial(n, p):
        return 0.0
    f = (p - 1) / p
    return 2 * _log2(p) * link.alpha + 2 * f * n * link.beta + f * n * link.gamma


def allreduce(n: float, p: int, link: LinkSpec, algorithm: str = "ring") -> float:
    """Allreduce by name: ``"ring"`` or ``"rhd"`` (recursive halving-doubling)."""
    if algorithm == "ring":
        return ring_allreduce(n, p, link)
    if algorithm in ("rhd", "recursive", "halving_doubling"):
        return rhd_allreduce(n, p, link)
    raise ValueError(f"unknown allreduce algorithm {algorithm!r}")


def recursive_doubling_allreduce(n: float, p: int, link: LinkSpec) -> float:
    """Recursive doubling, whole vectors each round: ``ceil(log2 p)(alpha + n beta + n gamma)``.

    The fewest messages of all: MPI libraries use it for short vectors, where the
    latency term is the whole cost (Thakur et al. 2005).
    """
    if _trivial(n, p):
        return 0.0
    return _log2(p) * (link.alpha + n * (link.beta + link.gamma))


def fastest_allreduce(n: float, p: int, link: LinkSpec) -> float:
    """The fastest of ring, recursive halving-doubling and recursive doubling for ``n``
    bytes: an MPI library's choice by size (short vectors go by recursive doubling)."""
    return min(ring_allreduce(n, p, link), rhd_allreduce(n, p, link),
               recursive_doubling_allreduce(n, p, link))


def ring_allgather(n: float, p: int, link: LinkSpec) -> float:
    """Ring allgather: ``(p-1) alpha + (p-1)/p n beta``."""
    if _trivial(n, p):
        return 0.0
    return (p - 1) * link.alpha + (p - 1) / p * n * link.beta


def ring_reduce_scatter(n: float, p: int, link: LinkSpec) -> float:
    """Ring reduce-scatter: ``(p-1) alpha + (p-1)/p n (beta + gamma)``."""
    if _trivial(n, p):
        return 0.0
    return (p - 1) * link.alpha + (p - 1) / p * n * (link.beta + link.gamma)


def binomial_broadcast(n: float, p: int, link: LinkSpec) -> float:
    """Binomial tree: ``ceil(log2 p) (alpha + n beta)``."""
    if _trivial(n, p):
        return 0.0
    return _log2(p) * (link.alpha + n * link.beta)


def linear_broadcast(n: float, p: int, link: LinkSpec) -> float:
    """Root sends to each peer in turn: ``(p-1)(alpha + n beta)``.

    The right form where every copy leaves through the root's one link (a
    GPU's PCIe lane under a shared switch, a process's NIC).
    """
    if _trivial(n, p):
        return 0.0
    return (p - 1) * (link.alpha + n * link.beta)


def binomial_reduce(n: float, p: int, link: LinkSpec) -> float:
    """Binomial tree reduce: ``ceil(log2 p)(alpha + n beta + n gamma)``."""
    if _trivial(n, p):
        return 0.0
    return _log2(p) * (link.alpha + n * (link.beta + link.gamma))


def linear_reduce(n: float, p: int, link: LinkSpec) -> float:
    """Every peer sends to the root through the root's link: ``(p-1)(alpha + n beta + n gamma)``."""
    if _trivial(n, p):
        return 0.0
    return (p - 1) * (link.alpha + n * (link.beta + link.gamma))


def broadcast(n: float, p: int, link: LinkSpec, algorithm: str = "binomial") -> float:
    """Broadcast by name: ``"binomial"`` or ``"linear"``."""
    if algorithm == "binomial":
        return binomial_broadcast(n, p, link)
    if algorithm == "linear":
        return linear_broadcast(n, p, link)
    raise ValueError(f"unknown broadcast algorithm {algorithm!r}")


def reduce(n: float, p: int, link: LinkSpec, algorithm: str = "binomial") -> float:
    """Reduce to one root by name: ``"binomial"`` or ``"linear"``."""
    if algorithm == "binomial":
        return binomial_reduce(n, p, link)
    if algorithm == "linear":
        return linear_reduce(n, p, link)
    raise ValueError(f"unknown reduce algorithm {algorithm!r}")


def alltoall(n: float, p: int, link: LinkSpec) -> float:
    """Pairwise exchange: ``(p-1)(alpha + n/p beta)``."""
    if _trivial(n, p):
        return 0.0
    return (p - 1) * (link.alpha + n / p * link.beta)
