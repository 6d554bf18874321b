"""Writing xarray Datasets to Zarr so that a plain ``xr.open_zarr(path)`` reads them.

Two details make that true with Zarr format 3: text coordinates are stored as
variable-length strings (fixed-width numpy strings have no v3 specification and
warn), and metadata is consolidated (without it, open_zarr warns and probes).
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any

import xarray as xr


def _as_object_strings(ds: xr.Dataset) -> xr.Dataset:
    for name, variable in ds.variables.items():
        if variable.dtype.kind == "U":
            ds[name] = variable.astype(object)
    return ds


def write_dataset(ds: xr.Dataset, path: str, **to_zarr: Any) -> None:
    """``ds.to_zarr(path, consolidated=True, **to_zarr)`` without format warnings."""
    ds = _as_object_strings(ds.copy())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Cc]onsolidated metadata.*")
        warnings.filterwarnings("ignore", message=".*does not have a Zarr V3 specification.*")
        ds.to_zarr(path, consolidated=True, **to_zarr)


def write_dataset_aside(ds: xr.Dataset, path: str) -> None:
    """Replace the store at `path` with `ds`, written beside it first (``PATH.partial``)
    and renamed into place: a write that fails (a full disk) leaves the old store
    whole, and removes its own half."""
    staging, old = f"{path}.partial", f"{path}.old"
    for leftover in (staging, old):  # from a run killed here before
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        write_dataset(ds, staging, mode="w")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(staging, path)
    shutil.rmtree(old, ignore_errors=True)
