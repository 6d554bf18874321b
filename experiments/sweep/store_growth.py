"""Growing a measured sweep's store to a bigger grid (``--extend``), crash-safely.

`grow_store` builds the grown store beside the old one (``<store>.growing``) from
the new sweep's template, copies each recorded point's chunk files byte for byte
into its new cell (`Growth.new_region`) with the checksums the old record holds for
them, recomputes speedup and efficiency over the grown grid (its baseline may have
moved: a smaller worker count added), verifies the result against its record, and
only then swaps it in. The caller holds the store's `SweepLock` throughout.

Why copies of the files rather than values read and written again: a point's
figures stay byte-identical, and the checksums recorded when it was measured keep
vouching for them (a copy that went wrong fails them at the verification before the
swap). Points the old store's verification finds damaged are not copied: they are
pending in the grown store, and run again, as a resume runs them.

The swap: on Linux one ``renameat2(RENAME_EXCHANGE)`` exchanges the two directories
atomically, and the old store, now at ``<store>.growing``, is removed. Where the
file system cannot exchange, the old store is renamed to ``<store>.replaced`` and
the grown one into place; `settle_growth`, at the next sweep's start (under the
lock), finishes a swap stopped between the two renames (the grown store is complete
once the first rename happened) and removes what a stopped growth left. So a sweep
killed at any moment leaves the old store intact or the grown one complete.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
from typing import Any

from experiments.sweep.config import Sweep
from experiments.sweep.growth import Growth
from experiments.sweep.results import ResultStore, StoreMismatch
from experiments.sweep.results_checksums import METADATA, StoreDamaged, point_key, read_metadata
from experiments.sweep.store_layout import build_template
from storage.locks import now_text

GROWING, REPLACED = ".growing", ".replaced"
#: The old store's attributes the grown one takes over as they are (who measured its
#: points, when, where); the rest describe the sweep and come from the new one.
KEPT_ATTRS = ("title", "sweep_name", "mode", "speedup_baseline", "versions", "machine",
              "code_revision", "command", "started", "finished", "sessions", "runs_dir",
              "growths")
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def settle_growth(path: str) -> None:
    """Before a sweep uses its store (the lock held): finish a swap stopped between
    its two renames, and remove a grown store left half-built or an old one left
    beside the store."""
    grown, aside = path + GROWING, path + REPLACED
    if not os.path.exists(path) and os.path.exists(aside):
        # the old store went aside only once the grown one was complete
        os.rename(grown if os.path.exists(grown) else aside, path)
    for leftover in (grown, aside, grown + ".creating"):
        if os.path.exists(leftover):
            shutil.rmtree(leftover)


def grow_store(path: str, sweep: Sweep, growth: Growth) -> None:
    """Replace the store at `path` by one of `sweep`'s grid holding every point it
    recorded (but damaged ones) in its new cell; see the module doc. StoreMismatch
    where the per-step series would change length (an added value of more
    `train.steps`). A `ResultStore` of `path` opened before must be opened again."""
    store = ResultStore(path)
    old_steps = int(read_metadata(os.path.join(path, "step_time_series", METADATA))
                    ["shape"][-1])
    if old_steps != sweep.steps:
        raise StoreMismatch(f"{store.path}: growing it would change the length of its "
                            f"per-step series ({old_steps} steps there, {sweep.steps} here); "
                            "pass --fresh to start over or --out for a new store")
    damaged = set(store.verify().damaged)
    grown = ResultStore(store.path + GROWING)
    try:
        grown.create(build_template(sweep, _grown_attrs(store.attrs(), sweep, growth)))
        copy_points(store, grown, growth, damaged)
        grown.refresh_derived()
        found = ResultStore(grown.path).verify()
        if found.damaged:  # a copy went wrong: the old store stays
            key, damage = next(iter(found.damaged.items()))
            raise StoreDamaged(f"{grown.path}: a copied point ({key}) is damaged: {damage}; "
                               f"{store.path} is unchanged")
    except BaseException:
        shutil.rmtree(grown.path, ignore_errors=True)
        raise
    swap_in(grown.path, store.path)  # stopped inside, `settle_growth` finishes it


def _grown_attrs(old: dict[str, Any], sweep: Sweep, growth: Growth) -> dict[str, Any]:
    """The grown store's attributes: the new sweep's description, the old store's
    history, and this growth added to `growths`."""
    attrs = {key: old[key] for key in KEPT_ATTRS if key in old}
    growths = json.loads(attrs.get("growths", "[]"))
    growths.append({"at": now_text(), "points_before": growth.old_points,
                    "points_after": growth.old_points + growth.new_points,
                    "changes": list(growth.changes)})
    attrs.update({"config": sweep.text, "config_file": os.path.abspath(sweep.source),
                  "fingerprint": sweep.fingerprint, "repeats": sweep.config.repeats,
                  "axes": json.dumps({axis.dim: list(axis.fields) for axis in sweep.axes}),
                  "growths": json.dumps(growths)})
    return attrs


def copy_points(old: ResultStore, new: ResultStore, growth: Growth,
                damaged: set[str]) -> None:
    """Copy each recorded point's chunk files (figures, texts, series, status) into
    its new cell, carrying their recorded checksums into the new record."""
    variables = set(new.record.data["point_variables"])
    ndim = len(growth.moves)
    for key, entry in old.record.data["points"].items():
        if key in damaged:
            continue
        region = tuple(int(i) for i in key.split("/"))
        target_key = point_key(growth.new_region(region)).split("/")
        files = {}
        for relative, checksum in entry["files"].items():
            name, _chunks, *indices = relative.split("/")
            if name not in variables:
                continue
            target = "/".join([name, "c", *target_key, *indices[ndim:]])
            destination = os.path.join(new.path, *target.split("/"))
            os.makedirs(os.path.dirname(destination), exist_ok=True)
            shutil.copyfile(os.path.join(old.path, *relative.split("/")), destination)
            files[target] = checksum
        new.record.data["points"]["/".join(target_key)] = {"status": entry["status"],
                                                           "files": files}
    new.record.save()


def swap_in(grown: str, path: str) -> None:
    """Put the directory `grown` at `path` and remove what was there (see the module
    doc: one atomic exchange where the system has it, else two renames)."""
    if _exchange(grown, path):
        shutil.rmtree(grown)  # the old store, exchanged
        return
    aside = path + REPLACED
    os.rename(path, aside)
    os.rename(grown, path)
    shutil.rmtree(aside)


def _exchange(first: str, second: str) -> bool:
    """Exchange two directories in one step (Linux ``renameat2``); False where the
    system or the file system cannot."""
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if function(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second),
                _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), second)
