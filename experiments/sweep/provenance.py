"""Where a sweep ran and with which code, as a store records it in its attrs.

Why: timings mean little without the machine (cores, memory, GPUs) and the code
revision that produced them; measured and scaling sweeps stamp both into the
store, and the measured report prints them. A measured store is written over
sessions (each run of the sweep command until it is done): each session records its
host, code revision and package versions, and where those that ran points differ,
the resuming sweep warns and the report says so (`mixed_sessions`), since the
store's own attributes are its first session's.
"""

from __future__ import annotations

import os
import platform
import socket
from typing import Any

import psutil

from pipeline.probe.machine import cpu_model
from pipeline.records.record import code_revision, software_versions

__all__ = ["code_revision", "machine_info", "mixed_sessions", "resume_warning",
           "session_provenance"]


def machine_info() -> dict[str, Any]:
    """Where the sweep ran: the figures mean little without it."""
    gpus: list[str] = []
    try:
        import torch

        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - a broken CUDA setup must not stop a CPU sweep
        pass
    return {"host": socket.gethostname(), "platform": platform.platform(),
            "cpu": cpu_model(), "cores": os.cpu_count(),
            "physical_cores": psutil.cpu_count(logical=False),
            "memory_bytes": psutil.virtual_memory().total, "gpus": gpus}


def session_provenance(scheduler: str | None = None) -> dict[str, Any]:
    """What a sweep's session records of where and with which code its points ran
    (beside its times): the client's host, the code revision, the package versions
    and the cluster (`scheduler`'s address, or ``embedded``). A store resumed
    elsewhere, on another cluster or after the code changed holds points of several,
    and `mixed_sessions` names them."""
    return {"host": socket.gethostname(), "code_revision": code_revision(),
            "versions": software_versions(), "cluster": scheduler or "embedded"}


def _differing(sessions: list[dict[str, Any]]) -> dict[str, Any]:
    """Per field that the sessions disagree on, how to say one session's value:
    the code revision, the host, the cluster, and the packages whose versions differ
    (a session written before it kept one of them counts as agreeing on it)."""
    said: dict[str, Any] = {}
    for name, key in (("code revision", "code_revision"), ("host", "host"),
                      ("cluster", "cluster")):
        if len({s.get(key) for s in sessions if s.get(key)}) > 1:
            said[name] = lambda s, key=key: str(s.get(key, "?"))
    versions = [s["versions"] for s in sessions if isinstance(s.get("versions"), dict)]
    packages = sorted({k for v in versions for k in v
                       if len({str(w.get(k)) for w in versions}) > 1})
    if packages:
        said["versions"] = lambda s: ", ".join(
            f"{k} {s.get('versions', {}).get(k, '?')}" for k in packages) \
            if isinstance(s.get("versions"), dict) else "not recorded"
    return said


def mixed_sessions(sessions: list[dict[str, Any]]) -> str | None:
    """One line saying how the sessions that ran points differ in code revision, host,
    cluster or package versions (each such session, numbered in the store's order, with what
    it ran), or None where they agree: a store resumed after `git pull`, on another
    machine or in another environment mixes their figures."""
    ran = [(index, s) for index, s in enumerate(sessions, start=1) if s.get("points_run")]
    said = _differing([s for _, s in ran])
    if not said:
        return None
    parts = [f"session {index} ({s.get('started', '?')}, {s['points_run']} point(s) run): "
             + ", ".join(f"{name} {text(s)}" for name, text in said.items())
             for index, s in ran]
    return (f"the store's points were measured under different {' and '.join(said)}: "
            + "; ".join(parts))


def resume_warning(earlier: list[dict[str, Any]], now: dict[str, Any]) -> str | None:
    """How this session (`now`, `session_provenance`) differs from the earlier ones
    that ran points, or None: ``code revision 1a2b3c4 there, 1a2b3c4-dirty here``."""
    ran = [s for s in earlier if s.get("points_run")]
    said = _differing(ran + [now])
    if not said or not ran:
        return None
    return "; ".join(f"{name} {' / '.join(dict.fromkeys(text(s) for s in ran))} there, "
                     f"{text(now)} here" for name, text in said.items())
