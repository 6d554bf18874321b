"""A probe's timings as the cost model sees them: each conv layer's table of points
(outliers left out), a worker as a `DeviceSpec`, the engine's network, the dense
head's FLOPs, the dataset store.

Apart from the probe's record (results.py) because this is the translation into
the model's terms, pure and tested on its own (tests/test_probe_robust.py); the
record only stores what was measured.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from pipeline.costmodel import (ConvLayer, DenseLayer, DeviceSpec, LayerTable, Network, Pool,
                                StoreSpec)
from pipeline.config.run_config import RunConfig
from pipeline.costmodel.compute import dense_stream_elements
from pipeline.probe.robust import inconsistent
from pipeline.probe.timings import ShardTiming
from tasks.specs import ConvLayerSpec, NetworkSpec, PoolSpec


def network_spec_from_dict(data: dict[str, Any]) -> NetworkSpec:
    """Rebuild a :class:`NetworkSpec` from ``asdict`` output (JSON lists included):
    every field, so that a zoo network (poolings, sources, residual sums, names,
    dropout) comes back equal to the spec it was made from."""
    conv = tuple(ConvLayerSpec(**{**layer, "pools": _pools(layer.get("pools"))})
                 for layer in data["conv"])
    tuples = {name: tuple(data[name]) for name in ("hidden", "dense_names", "dropout")
              if name in data}
    rest = {name: data[name] for name in ("init", "preset") if name in data}
    return NetworkSpec(conv, classes=int(data["classes"]), dtype=str(data["dtype"]),
                       **tuples, **rest)


def _pools(pools: Sequence[dict[str, Any]] | None) -> tuple[PoolSpec, ...] | None:
    """A layer's poolings from JSON (a list of dicts), None where the layer has the
    paper family's ``pool``."""
    return None if pools is None else tuple(PoolSpec(**pool) for pool in pools)


def model_network(config: RunConfig, spec: NetworkSpec) -> Network:
    """A run's network (``spec``: `pipeline.strategies.base.network_for`) for the cost
    model, with the SGD it trains with: what the update streams, what memory holds."""
    return costmodel_network(spec, *config.optimizer_spec().kind)


def costmodel_network(spec: NetworkSpec, momentum: bool = True, weight_decay: bool = True,
                      nesterov: bool = False) -> Network:
    """The engine's network for the cost model: every conv layer with what follows it
    (batch norm, the residual sum, ReLU, poolings), its source, and the dense head with
    its dropout; the SGD it trains with: `momentum` (momentum buffers, held and
    streamed: a config's ``train.momentum`` above 0), `weight_decay` (above 0) and
    `nesterov`, each a pass of the update (`Network.update_accesses`).

    Layers are named ``conv1``, ``conv2``, ... as the probe's tables are, and dense
    layers ``fc1``, ``fc2``, ... The shapes are checked against the engine's.
    """
    convs = [ConvLayer(in_channels=c.in_channels, out_channels=c.kernels,
                       in_hw=(c.in_height, c.in_width), kernel=c.kernel_size,
                       stride=c.stride, padding=c.padding, pool=c.pool,
                       pools=None if c.pools is None else tuple(
                           Pool(p.kind, p.window, p.stride, p.padding) for p in c.pools),
                       name=f"conv{l + 1}", bias=c.bias, batch_norm=c.batch_norm,
                       relu=c.relu, source=c.source, residual=c.residual)
             for l, c in enumerate(spec.conv)]
    widths = [spec.flat_features, *spec.hidden, spec.classes]
    dense = [DenseLayer(a, b, name=f"fc{j + 1}") for j, (a, b) in
             enumerate(zip(widths, widths[1:]))]
    net = Network(tuple(convs), tuple(dense), name=spec.preset or "engine",
                  dropout=tuple(spec.dropout), momentum=momentum,
                  weight_decay=weight_decay, nesterov=nesterov and momentum)
    for ours, theirs in zip(net.conv, spec.conv):
        if (ours.out_hw, ours.conv_hw) != ((theirs.out_height, theirs.out_width),
                                           (theirs.conv_height, theirs.conv_width)):
            raise ValueError(f"cost model shapes differ from the engine's at {ours.name}")
    return net


def _view(timings: Sequence[ShardTiming], layer: int, active: int) -> list[ShardTiming]:
    """The timings of ``layer`` the model uses with ``active`` workers running: those
    measured so, and other counts' at the kernel counts those lack."""
    mine = [t for t in timings if t.layer == layer]
    exact = {t.kernels for t in mine if t.active == active}
    return [t for t in mine if t.active == active or t.kernels not in exact]


def _median(values: Sequence[float | None]) -> float | None:
    """The median of the values given (None: none given)."""
    given = [v for v in values if v is not None]
    return float(np.median(given)) if given else None


def table_points(timings: Sequence[ShardTiming], layer: int, active: int
                 ) -> dict[int, tuple[float, float, float, float | None]]:
    """``kernels -> (forward, backward, input_grad, dataset)`` of one layer as the model
    sees it with ``active`` workers running (`_view`; several at one count: their
    median; ``dataset`` None where none was timed), less the points that break "time
    grows with kernels" (`robust.inconsistent`)."""
    by_k: dict[int, list[ShardTiming]] = {}
    for t in _view(timings, layer, active):
        by_k.setdefault(t.kernels, []).append(t)
    points = {k: (_median([t.forward_s for t in ts]), _median([t.backward_s for t in ts]),
                  _median([t.input_grad_s for t in ts]), _median([t.dataset_s for t in ts]))
              for k, ts in by_k.items()}
    dropped = inconsistent({k: v[:2] for k, v in points.items()})
    return {k: v for k, v in sorted(points.items()) if k not in dropped}


def mark_outliers(timings: list[ShardTiming]) -> list[ShardTiming]:
    """``timings`` with ``outlier`` set on each one some table of the model leaves out
    (`table_points`, for every count of workers running that was measured)."""
    left_out: set[tuple[int, int, int]] = set()
    for layer, active in {(t.layer, t.active) for t in timings}:
        kept = table_points(timings, layer, active)
        left_out |= {(t.layer, t.kernels, t.active) for t in _view(timings, layer, active)
                     if t.kernels not in kept}
    return [replace(t, outlier=(t.layer, t.kernels, t.active) in left_out) for t in timings]


def device_spec(name: str, timings: Sequence[ShardTiming], net: Network, batch: int,
                active: int, dense_rate: float | None = None, mem_bw: float = math.inf,
                bytes_per_elem: int = 4) -> DeviceSpec:
    """A worker's timings as a cost-model device: a `LayerTable` per conv layer
    measured (`table_points`), their mean rate, the dense head's efficiency against
    it (`dense_rate`: its products' measured FLOP/s, `head_rate`; None: as fast as
    the convs), and its memory rate (`mem_bw`, B/s; inf: not measured) over elements
    of `bytes_per_elem` bytes (the network's dtype)."""
    tables, rates = {}, {}
    for index, conv in enumerate(net.conv):
        points = table_points(timings, index, active)
        if not points:
            continue
        table = LayerTable.from_points(batch, [(k, *v) for k, v in points.items()])
        tables[conv.name] = table
        k = table.kernels[-1]
        seconds = table.forward[-1] + table.backward[-1]
        flops = conv.forward(batch, k).flops + conv.backward_weight(batch, k).flops
        if index > 0:
            flops += conv.backward_input(batch, k).flops
        rates[conv.name] = flops / seconds
    mean = float(np.mean(list(rates.values()))) if rates else 1e9
    dense_eff = 1.0 if dense_rate is None else dense_rate / mean
    return DeviceSpec(flops=mean, mem_bw=mem_bw, bytes_per_elem=bytes_per_elem,
                      dense_efficiency=dense_eff, layer_rates=rates, layer_tables=tables,
                      name=name)


#: The least part of a dense head's measured time left to its products once its
#: element-wise work is taken out: a memory rate measured low cannot make them free.
MIN_PRODUCT_SHARE = 0.5


def head_rate(net: Network, batch: int, seconds: float, mem_bw: float = math.inf,
              bytes_per_elem: int = 4) -> float:
    """FLOP/s of the dense head's products, from `seconds` of the whole head as the
    master's ``dense-head`` op runs it (dropout and SGD step included): the model
    prices that element-wise work at the memory rate `mem_bw` (`dense_time`), so it
    comes out of the time first, leaving at least `MIN_PRODUCT_SHARE` of it."""
    elements = sum(dense_stream_elements(net.dense, batch, dropout=net.dropout))
    streams = bytes_per_elem * elements / mem_bw
    return dense_flops(net, batch) / max(seconds - streams, MIN_PRODUCT_SHARE * seconds)


def dense_flops(net: Network, batch: int) -> float:
    """FLOPs of the dense head's forward and both backward products (as the model counts)."""
    total = 0.0
    for i, layer in enumerate(net.dense):
        total += layer.forward(batch).flops + layer.backward_weight(batch).flops
        if i > 0 or net.conv:
            total += layer.backward_input(batch).flops
    return total


def dataset_store(seconds: float | None) -> StoreSpec | None:
    """The dataset store as a latency per batch read (``None``: not measured)."""
    if seconds is None:
        return None
    return StoreSpec(write_bw=math.inf, read_bw=math.inf, latency=seconds)
