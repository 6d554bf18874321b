"""The report folder (``--out``): it holds one report and nothing else.

An earlier report there (of this store or another: a report is drawn again from its
store at will) is replaced wholly: its files, every one a name a report writes
(`report_file`), are removed before the new report is drawn, so a measured sweep's
figures are never left beside a scaling sweep's report.md. A folder that holds
anything else (a run's results, a sweep store, configs, a sweep's `.runs`) is
refused before anything is written or removed, as is the filesystem root.
"""

from __future__ import annotations

import os


#: Every figure a report may write under a fixed name (a measured sweep's, a predict
#: store's, a scaling sweep's); `NAMED_BY_DATA` prefixes name the others.
FIXED_FIGURES = frozenset({
    "strategies.png", "speedup.png", "breakdown.png", "batch.png", "placement.png",
    "memory.png", "step_times.png", "prediction.png", "predicted.png", "links.png",
    "winner_workers_batch.png", "winner_workers_bandwidth.png", "scaling_speedup.png"})
#: Prefixes of figures named after what a store holds (`growth_<strategy>.png`, a
#: scaling report's `winner_<network>.png`).
NAMED_BY_DATA = ("growth_", "winner_")


class OutDirRefused(ValueError):
    """`--out` names a folder that must not hold the report (said as one line)."""


def report_file(out_dir: str, name: str) -> bool:
    """Whether `name` in `out_dir` is a file a report writes (a plain file, not a link)."""
    path = os.path.join(out_dir, name)
    if os.path.islink(path) or not os.path.isfile(path):
        return False
    return name == "report.md" or (name.endswith(".png") and (
        name in FIXED_FIGURES or name.startswith(NAMED_BY_DATA)))


def prepare_report_folder(out_dir: str, store: str) -> None:
    """Make `out_dir` ready for the store's report: made if missing, emptied of an
    earlier report; OutDirRefused, with nothing removed, where it holds anything else."""
    real = os.path.realpath(out_dir)
    if real == os.path.realpath(os.sep):
        raise OutDirRefused(f"--out: {out_dir} is the filesystem root; choose a folder "
                            "for the report")
    inside = os.path.relpath(real, os.path.realpath(store))
    if inside != os.pardir and not inside.startswith(os.pardir + os.sep):  # read as damage
        raise OutDirRefused(f"--out: {out_dir} is inside the results store {store}; choose "
                            "a directory outside it")
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise OutDirRefused(f"--out: {out_dir} is not a folder; choose a folder for the report")
    try:
        os.makedirs(out_dir, exist_ok=True)
        names = os.listdir(out_dir)
    except OSError as error:  # no permission, no space
        raise OutDirRefused(f"--out: {out_dir} cannot hold the report "
                            f"({error.strerror or error})") from None
    others = sorted(name for name in names if not report_file(out_dir, name))
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise OutDirRefused(f"--out: {out_dir} holds files or folders that are not a "
                            f"report's ({shown}); choose an empty folder, a new one or an "
                            "earlier report's")
    remove_report(out_dir)


def remove_report(out_dir: str) -> None:
    """Remove every report file in `out_dir` (an earlier report, or a partial one)."""
    for name in os.listdir(out_dir):
        if report_file(out_dir, name):
            os.remove(os.path.join(out_dir, name))
