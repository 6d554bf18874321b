"""A scaling sweep's store as its report reads it: which dim holds which field, and
which strategy wins.

`ScalingView` finds the strategy, devices, batch and bandwidth dims, labels their
values and lays out the panels a figure shows (dims it does not show fixed at their
last value); `winners` picks the fastest strategy per cell (ties, within `TIE`,
to the one listed first).

Why apart from the figures and report.md (:mod:`experiments.scaling.report`): the
winner maps, the speedup curves and the winner table must agree on the layout
and on who wins.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import xarray as xr
import yaml

from experiments.scaling.config import build_point
from experiments.sweep.store_layout import DONE
from pipeline.config.schema import ConfigError, to_dict

__all__ = ["ScalingView", "winners"]

TIE = 1e-9  # relative difference under which predicted times count as equal
#: How an axis label names a field of a zipped dim.
FIELD_NAMES = {"hardware.devices": "devices", "train.batch": "batch",
               "hardware.link.gbps": "link Gb/s", "network.preset": "network"}


class ScalingView:
    """A scaling store plus what its figures need: which dim holds which field."""

    def __init__(self, ds: xr.Dataset) -> None:
        self.ds = ds
        self.axes: dict[str, list[str]] = json.loads(ds.attrs.get("axes", "{}"))
        self.dims = [d for d in ds.status.dims if d != "repeat"]

    def base_point(self) -> dict[str, Any]:
        """The point every grid position starts from, with its defaults filled in (as
        written where this code no longer reads it; empty where the store lacks it)."""
        try:
            base = (yaml.safe_load(self.ds.attrs.get("config", "")) or {}).get("base")
        except (yaml.YAMLError, AttributeError):
            return {}
        if not isinstance(base, dict):
            return {}
        try:
            return to_dict(build_point(copy.deepcopy(base)))
        except (ConfigError, TypeError, ValueError):
            return base

    def swept_fields(self) -> set[str]:
        return {field for fields in self.axes.values() for field in fields}

    def dim_with(self, field: str) -> str | None:
        return next((dim for dim, names in self.axes.items() if field in names), None)

    def _role(self, field: str, before: tuple[str, ...]) -> str | None:
        """The dim of ``field``, unless a field of ``before`` holds it: a field zipped
        with the devices (weak scaling: the batch moves with them) rides along that dim
        and is no dim of its own to lay a figure or a table out by."""
        dim = self.dim_with(field)
        taken = {self.dim_with(earlier) for earlier in before}
        return None if dim in taken else dim

    @property
    def strategy_dim(self) -> str | None:
        return self.dim_with("strategy")

    @property
    def workers_dim(self) -> str | None:
        return self._role("hardware.devices", ("strategy",))

    @property
    def batch_dim(self) -> str | None:
        return self._role("train.batch", ("strategy", "hardware.devices"))

    @property
    def bandwidth_dim(self) -> str | None:
        return self._role("hardware.link.gbps", ("strategy", "hardware.devices", "train.batch"))

    @property
    def network_dim(self) -> str | None:
        return self._role("network.preset", ("strategy", "hardware.devices", "train.batch",
                                             "hardware.link.gbps"))

    def of_network(self, network: str) -> "ScalingView":
        """The view of one network's points (its dim kept, of length one)."""
        index = self.labels(self.network_dim).index(network)
        return ScalingView(self.ds.isel({self.network_dim: [index]}))

    def device_counts(self, dim: str) -> list[int | None]:
        """Per position of the devices dim: its device count, or None for a mix (a dim
        zipping several fields has a coordinate per field)."""
        coord = self.ds[dim]
        if len(self.axes.get(dim, [])) > 1:
            coord = next((c for c in self.ds.coords.values() if c.dims == (dim,)
                          and c.attrs.get("field") == "hardware.devices"), None)
        elif coord.dtype.kind not in "iu":
            coord = self.ds.coords.get(f"{dim}_value")
        if coord is None:
            return [None] * self.ds.sizes[dim]
        values = [v if coord.dtype.kind in "iu" else json.loads(str(v)) for v in coord.values]
        return [int(v) if isinstance(v, (int, np.integer)) else None for v in values]

    def plain_counts(self, dim: str) -> np.ndarray:
        """Per position of the devices dim: whether it is a device count (not a mix)."""
        return np.array([count is not None for count in self.device_counts(dim)])

    def labels(self, dim: str) -> list[str]:
        return [_label(v) for v in self.ds[dim].values]

    def title(self, dim: str, value: str) -> str:
        if dim == self.bandwidth_dim:
            return f"link {value} Gb/s"
        return f"{dim} {value}" + (f" {self.units(dim)}" if self.units(dim) else "")

    def units(self, dim: str) -> str:
        """A dim's units where its values need them said ("" for counts, names and
        the roles a figure or table names anyway: devices, batch, link bandwidth)."""
        units = str(self.ds[dim].attrs.get("units", ""))
        roles = (self.workers_dim, self.batch_dim, self.bandwidth_dim)
        return "" if dim in roles or units in ("1", "") else units

    def header(self, dim: str) -> str:
        """A table's column over `dim`: its name, and its units where needed."""
        return f"{dim} ({self.units(dim)})" if self.units(dim) else dim

    def axis_name(self, dim: str) -> str:
        fields = self.axes.get(dim, [])
        if len(fields) > 1:  # a zip: its labels read "1/32"
            return " / ".join(FIELD_NAMES.get(f, f) for f in fields)
        if dim == self.bandwidth_dim:
            return "link bandwidth (Gb/s)"
        if dim == self.workers_dim:
            return "devices"
        if dim == self.batch_dim:
            return "batch (samples per step, all devices)"
        return dim

    def times(self) -> xr.DataArray:
        """Predicted step times of done points (NaN elsewhere), repeat dropped."""
        done = self.ds.status == DONE
        return self.ds.predicted_step_time.where(done).isel(repeat=0)

    def layout(self, shown: list[str]) -> tuple[str | None, dict[str, Any], str]:
        """The dim for panel rows among those not shown, and the others fixed.

        Returns ``(row dim or None, {dim: fixed value}, text naming the fixed ones)``;
        the text opens with what every point shares (`stands_on`): a figure on its own,
        as a paper prints it, says which device and links it is about.
        """
        rest = [d for d in self.dims if d not in shown]
        rows = next((d for d in rest if self.ds.sizes[d] > 1), None)
        fixed = {d: self.ds[d].values[-1] for d in rest if d != rows}
        text = ", ".join(self.stands_on() + [self.title(d, _label(v))
                                             for d, v in fixed.items()])
        return rows, fixed, text

    def stands_on(self) -> list[str]:
        """What every point shares that a figure must say, as it is not swept: the
        device kind, the link's bandwidth and latency, a shared store."""
        swept, point = self.swept_fields(), self.base_point()
        hardware = point.get("hardware") if isinstance(point.get("hardware"), dict) else {}
        link = hardware.get("link") if isinstance(hardware.get("link"), dict) else {}
        store = hardware.get("store")
        said = [("hardware.device", "device {}", hardware.get("device")),
                ("hardware.link.gbps", "link {} Gb/s", link.get("gbps")),
                ("hardware.link.latency_us", "latency {} us", link.get("latency_us")),
                ("hardware.store.gbps", "store {} Gb/s",
                 store.get("gbps") if isinstance(store, dict) else None)]
        return [text.format(_label(value)) for field, text, value in said
                if value is not None and not any(field == f or field.startswith(f + ".")
                                                 for f in swept)]


def _label(value: Any) -> str:
    """A coordinate's value as figures and tables write it: a whole number as one
    (10, not 10.0), a large or fractional one in four figures (1e+12, 2.039e+12)."""
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return str(int(value)) if value.is_integer() and abs(value) < 1e6 else f"{value:.4g}"
    return str(value)


def winners(times: np.ndarray) -> np.ndarray:
    """Index of the fastest along axis 0 (ties: the first), -1 where none has a time."""
    filled = np.where(np.isfinite(times), times, np.inf)
    best = filled.min(axis=0)
    close = filled <= best * (1 + TIE)
    index = np.argmax(close, axis=0)
    return np.where(np.isfinite(best), index, -1)


def one_device_only(ds: xr.Dataset) -> bool:
    """Whether every point of `ds` used one device (a strategy such as `single`, the
    speedup's baseline: it does not scale, so summaries and plots set it apart)."""
    used = ds.n_workers.values[np.isfinite(ds.n_workers.values)]
    return bool(used.size) and bool((used <= 1).all())
