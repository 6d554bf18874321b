"""Points whose repeats ran different splits, as a report.md table (pure).

Each repeat of a point places its work again: a calibrated placement measures the
workers at that moment, and on a loaded machine two repeats of one point can split
it differently (one gave all kernels to the half-speed worker, the other left it out).
The main table's median then pools different placements, and its repeat spread is
theirs, not the machine's noise; the "Device mixes" table shows the first repeat's
only. This table names such points, each repeat's split and the workers it ran on,
so that a figure built on them can say so, or be measured again on one split
(`placement: recorded`).
"""

from __future__ import annotations

import json

import numpy as np
import xarray as xr

from experiments.sweep.store_layout import DONE

SPLITS = ("kernel_split", "batch_split")


def _workers(text: str) -> str:
    """The workers of a repeat's `worker_devices` text, by name, in split order."""
    try:
        return ", ".join(str(worker[0]) for worker in json.loads(text))
    except (ValueError, TypeError, IndexError, KeyError):
        return "?"


def split_changes(ds: xr.Dataset) -> list[tuple[str, list[str]]]:
    """(point, each done repeat's split and workers) for every point whose done
    repeats recorded more than one split."""
    dims = [d for d in ds.status.dims if d != "repeat"]
    status = ds.status.values
    devices = ds["worker_devices"].values if "worker_devices" in ds else None
    found = []
    for name in (n for n in SPLITS if n in ds):
        values = ds[name].transpose(*dims, "repeat").values
        for position in np.ndindex(*status.shape[:-1]):
            done = [r for r in range(status.shape[-1]) if status[position][r] == DONE
                    and str(values[position][r]) not in ("", "[]")]
            if len({str(values[position][r]) for r in done}) < 2:
                continue
            where = " ".join(f"{d}={ds[d].values[i]}" for d, i in zip(dims, position))
            found.append((where, [
                f"repeat {r}: {values[position][r]}" + (
                    f" on {_workers(str(devices[position][r]))}" if devices is not None
                    else "") for r in done]))
    return found


def split_changes_section(ds: xr.Dataset) -> list[str]:
    """report.md's table of `split_changes` (nothing where every point kept one)."""
    found = split_changes(ds)
    if not found:
        return []
    return ["## Repeats that ran different splits", "",
            "Each repeat places its work again; at these points the repeats split it "
            "differently, so the main table's median pools different placements and its "
            "repeat spread is theirs. Measure one split again with `placement: recorded` "
            "(docs/training.md) to compare like with like.", "",
            "| point | each repeat's split |", "|---|---|",
            *(f"| {where} | {'; '.join(splits)} |" for where, splits in found), ""]
