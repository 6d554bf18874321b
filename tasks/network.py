"""The network as plain torch modules: the one definition every strategy's arithmetic
follows, and the single source of initial weights and checkpoint names.

`SpecNetwork` holds nn.Conv2d, nn.BatchNorm2d and nn.Linear modules under the names the
`NetworkSpec` gives them (torchvision's for the zoo, ``tasks/zoo.py``), so that its
state_dict, and every checkpoint, loads into torchvision's own model; its forward
follows the spec: per conv layer, conv -> batch norm -> + residual -> ReLU ->
poolings, then flatten -> (dropout ->) dense (-> ReLU). It lives in `tasks` because
workers build replicas and the dense head from it. Every strategy starts from
`initial_state`, built with the run's seed, so that distributed training can be
compared with, and its checkpoints loaded into, ordinary PyTorch (`load_model`).

Dropout draws its masks in blocks of `MASK_BLOCK_ROWS` rows of the batch, each from a
generator seeded by (run seed, step, dense layer, block) (`dropout_mask`), so that a
replica draws only its own rows' blocks, yet its rows, the master's head and a
plain-PyTorch replay all see the same mask (docs/methods.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tasks.pooling import MaxPool
from tasks.specs import ConvLayerSpec, NetworkSpec, PoolSpec

BUFFER_COUNTER = "num_batches_tracked"


#: Rows of a batch drawn from one generator in a dropout mask. A replica draws whole
#: blocks, so fewer than a block's rows it does not use at either end of its rows; a
#: block's seeding (about 2 us) is small against its draw (8 x 1024 uniforms: 30 us).
MASK_BLOCK_ROWS = 8

#: Rows of a batch: a slice, or row indices (a list, a numpy array; negative from the end).
Rows = slice | Sequence[int] | np.ndarray


def dropout_block_seeds(seed: int, step: int, layer: int, blocks: np.ndarray) -> np.ndarray:
    """The generator seeds of blocks `blocks` of dense layer `layer`'s dropout mask at
    `step`: word b of `SeedSequence([seed, step, layer])`'s state for block b, shifted
    right by one (a word does not depend on how many are generated, so one call serves
    every block asked)."""
    if not len(blocks):
        return np.zeros(0, np.uint64)
    sequence = np.random.SeedSequence([seed, step, layer])
    words = sequence.generate_state(int(blocks.max()) + 1, np.uint64)
    return words[blocks] >> np.uint64(1)


def batch_rows(rows: Rows | None, batch: int) -> np.ndarray:
    """The row indices `rows` names of a batch of `batch` (None: every row), found
    without listing the batch's rows: a replica's cost is its rows'."""
    if rows is None or isinstance(rows, slice):
        picked = range(batch)[rows or slice(None)]
        return np.arange(picked.start, picked.stop, picked.step)
    indices = np.asarray(rows, dtype=np.int64).reshape(-1)
    if np.any((indices < -batch) | (indices >= batch)):
        raise IndexError(f"rows {indices.tolist()} of a batch of {batch}")
    return indices % max(batch, 1)


def dropout_uniforms(seed: int, step: int, layer: int, shape: tuple[int, ...],
                     rows: np.ndarray) -> torch.Tensor:
    """The float32 uniform draws of rows `rows` of a mask of shape `shape`: only the
    blocks of `MASK_BLOCK_ROWS` rows that hold them, each from its own generator."""
    batch, features = shape[0], tuple(shape[1:])
    block_of_row = rows // MASK_BLOCK_ROWS
    blocks = np.unique(block_of_row)
    lengths = np.minimum(MASK_BLOCK_ROWS, batch - blocks * MASK_BLOCK_ROWS)
    offsets = np.concatenate([[0], np.cumsum(lengths)])  # of each block in `drawn`
    drawn = torch.empty((int(offsets[-1]), *features), dtype=torch.float32)
    generator = torch.Generator()
    seeds = dropout_block_seeds(seed, step, layer, blocks).tolist()
    for block_seed, start, stop in zip(seeds, offsets[:-1].tolist(), offsets[1:].tolist()):
        drawn[start:stop].uniform_(generator=generator.manual_seed(block_seed))
    block_offset = offsets[np.searchsorted(blocks, block_of_row)]
    return _take_rows(drawn, block_offset + rows % MASK_BLOCK_ROWS)


def _take_rows(tensor: torch.Tensor, positions: np.ndarray) -> torch.Tensor:
    """Rows `positions` of `tensor`: a view where they are a run of consecutive rows."""
    first = int(positions[0]) if len(positions) else 0
    if np.array_equal(positions, np.arange(first, first + len(positions))):
        return tensor[first:first + len(positions)]
    return tensor[torch.from_numpy(positions)]


def dropout_mask(seed: int, step: int, layer: int, shape: tuple[int, ...], p: float,
                 dtype: torch.dtype, rows: Rows | None = None) -> torch.Tensor:
    """Dropout's multiplier for rows `rows` (default: all) of a batch of shape `shape`:
    1/(1-p) where a unit is kept (a float32 uniform draw >= p), 0 where it is dropped;
    on the CPU. Only the blocks of rows asked are drawn, so ``dropout_mask(...,
    rows=r)`` equals ``dropout_mask(...)[r]`` bit for bit, at the cost of r's rows."""
    keep = dropout_uniforms(seed, step, layer, shape, batch_rows(rows, shape[0])).ge_(p)
    return keep.to(dtype).mul_(1.0 / (1.0 - p))


class SeededDropout(nn.Module):
    """Dropout with a mask a replay can draw again: `set_dropout` says the step (and
    which rows of the batch this module sees); evaluation mode passes through."""

    def __init__(self, p: float, layer: int) -> None:
        super().__init__()
        self.p, self.layer = p, layer
        self.draw: tuple[int, int, Rows | None, int] | None = None  # seed, step, rows, batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.draw is None:
            raise RuntimeError("dropout in training needs set_dropout(model, seed, step)")
        seed, step, rows, batch = self.draw
        whole = batch if batch > 0 else x.shape[0]  # -1: x is the whole batch
        mask = dropout_mask(seed, step, self.layer, (whole, *x.shape[1:]), self.p, x.dtype,
                            rows)
        return x * mask.to(x.device)

    def extra_repr(self) -> str:
        return f"p={self.p}, layer={self.layer}"


def set_dropout(model: nn.Module, seed: int, step: int, rows: Rows | None = None,
                batch: int | None = None) -> None:
    """Point every dropout of `model` at `step`; `rows` of a batch of `batch` (default:
    the whole batch the module is given), of which only those rows' masks are drawn."""
    for module in model.modules():
        if isinstance(module, SeededDropout):
            module.draw = (seed, step, rows, batch or -1)


def backward_from(output: torch.Tensor, grad: torch.Tensor) -> None:
    """``output.backward(grad)``, straight into autograd's engine.

    Why not `Tensor.backward`: it checks an explicit gradient's shape with torch.fx's
    symbolic shapes, whose first use imports sympy (about 40 MB in every worker that
    does). The stand-in ``(output * grad).sum().backward()`` hands the graph the same
    bits but costs two passes over the tensor: 4-5 ms a layer of ResNet-20's first
    stage at batch 128, about a tenth of `single`'s step. The shape is checked here."""
    if output.shape != grad.shape:
        raise ValueError(f"a gradient of shape {tuple(grad.shape)} for an output of shape "
                         f"{tuple(output.shape)}")
    torch.autograd.Variable._execution_engine.run_backward(  # what backward() calls
        (output,), (grad,), False, False, (), True, True)


def pool(x: torch.Tensor, spec: PoolSpec, fast: bool = False) -> torch.Tensor:
    """One pooling as PyTorch's functional ops compute it (`fast`: a max-pool whose
    window is its stride through the channels-last kernel, tasks/pooling.py)."""
    if spec.kind == "adaptive_avg":
        return F.adaptive_avg_pool2d(x, spec.window)
    if spec.kind == "avg":
        return F.avg_pool2d(x, spec.window, spec.stride, spec.padding)
    if fast and spec.window == spec.stride and spec.padding == 0:
        return MaxPool(spec.window)(x)
    return F.max_pool2d(x, spec.window, spec.stride, spec.padding)


def _attach(root: nn.Module, name: str, module: nn.Module) -> None:
    """Register `module` at the dotted `name` under `root`, making the parents."""
    *parents, leaf = name.split(".")
    for part in parents:
        if not hasattr(root, part):
            root.add_module(part, nn.Module())
        root = getattr(root, part)
    root.add_module(leaf, module)


def make_conv(layer: ConvLayerSpec) -> nn.Conv2d:
    return nn.Conv2d(layer.in_channels, layer.kernels, layer.kernel_size, layer.stride,
                     layer.padding, bias=layer.bias)


class SpecNetwork(nn.Module):
    """The network of a `NetworkSpec` (``parts``: the conv ``trunk``, the dense
    ``head``, or both), its tensors under the spec's names."""

    def __init__(self, spec: NetworkSpec, fast_pool: bool = False,
                 parts: tuple[str, ...] = ("trunk", "head")) -> None:
        super().__init__()
        self.spec, self.fast_pool = spec, fast_pool
        self.convs: list[nn.Conv2d] = []
        self.norms: list[nn.BatchNorm2d | None] = []
        if "trunk" in parts:
            for layer in spec.conv:
                self.convs.append(make_conv(layer))
                _attach(self, layer.name, self.convs[-1])
                norm = nn.BatchNorm2d(layer.kernels) if layer.batch_norm else None
                if norm is not None:
                    _attach(self, layer.bn_name, norm)
                self.norms.append(norm)
        self.linears: list[nn.Linear] = []
        self.dropouts: list[SeededDropout | None] = []
        if "head" in parts:
            features = spec.flat_features
            for j, (name, width) in enumerate(zip(spec.dense_names,
                                                  [*spec.hidden, spec.classes])):
                p = spec.dense_dropout(j)
                self.dropouts.append(SeededDropout(p, j) if p > 0 else None)
                if p > 0:  # its own name: the dense layers' keep torchvision's
                    self.add_module(f"dropout{j}", self.dropouts[-1])
                self.linears.append(nn.Linear(features, width))
                _attach(self, name, self.linears[-1])
                features = width
        _initialise(self, spec.init)

    def layer_output(self, layer: int, x: torch.Tensor,
                     outputs: list[torch.Tensor | None]) -> torch.Tensor:
        """Conv layer `layer` from its input `x` (and the earlier `outputs`, for a
        residual sum): conv -> batch norm -> + residual -> ReLU -> poolings."""
        spec = self.spec.conv[layer]
        z = self.convs[layer](x)
        if self.norms[layer] is not None:
            z = self.norms[layer](z)
        if spec.residual is not None:
            z = z + outputs[spec.residual]
        if spec.relu:
            z = F.relu(z)
        for pooling in spec.pooling:
            z = pool(z, pooling, self.fast_pool)
        return z

    def trunk(self, images: torch.Tensor) -> torch.Tensor:
        """The conv layers: the last one's output (before flattening)."""
        last_use = _last_uses(self.spec)
        outputs: list[torch.Tensor | None] = []
        for layer in range(len(self.spec.conv)):
            source = self.spec.source(layer)
            x = images if source < 0 else outputs[source]
            outputs.append(self.layer_output(layer, x, outputs))
            for earlier, last in enumerate(last_use):
                if last == layer and earlier < layer:
                    outputs[earlier] = None  # no later layer reads it
        return outputs[-1]

    def head(self, features: torch.Tensor) -> torch.Tensor:
        """Flatten -> (dropout ->) dense (-> ReLU, but the last): the logits."""
        x = features.flatten(1)
        for j, linear in enumerate(self.linears):
            if self.dropouts[j] is not None:
                x = self.dropouts[j](x)
            x = linear(x)
            if j < len(self.linears) - 1:
                x = F.relu(x)
        return x

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(images))


def _last_uses(spec: NetworkSpec) -> list[int]:
    """For each conv layer, the last layer that reads or adds its output."""
    last = list(range(len(spec.conv)))
    for layer, conv in enumerate(spec.conv):
        for used in (spec.source(layer), conv.residual):
            if used is not None and used >= 0:
                last[used] = max(last[used], layer)
    return last


def _initialise(model: nn.Module, scheme: str) -> None:
    """torchvision's initialisation for VGG or ResNet; PyTorch's defaults otherwise.
    Nothing on the meta device (`checkpoint_shapes`): it holds no values, and
    `kaiming_normal_` there imports torch's compiler (1 s and 76 MB a process)."""
    if scheme == "pytorch" or any(p.is_meta for p in model.parameters()):
        return
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            if module.bias is not None:
                nn.init.constant_(module.bias, 0)
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.constant_(module.weight, 1)
            nn.init.constant_(module.bias, 0)
        elif isinstance(module, nn.Linear) and scheme == "vgg":
            nn.init.normal_(module.weight, 0, 0.01)
            nn.init.constant_(module.bias, 0)


def build_network(spec: NetworkSpec, fast_pool: bool = False) -> SpecNetwork:
    """The whole network in the spec's dtype (``fast_pool``: the workers' replicas'
    max-pools, `pool`; plain PyTorch's otherwise, as the reference runs them)."""
    return SpecNetwork(spec, fast_pool).to(getattr(torch, spec.dtype))


def conv_trunk(spec: NetworkSpec, fast_pool: bool = False) -> SpecNetwork:
    """The conv layers alone (call `.trunk`), with the whole network's keys."""
    return SpecNetwork(spec, fast_pool, ("trunk",)).to(getattr(torch, spec.dtype))


def dense_stack(spec: NetworkSpec) -> SpecNetwork:
    """The dense layers alone (call `.head`), with the whole network's keys."""
    return SpecNetwork(spec, parts=("head",)).to(getattr(torch, spec.dtype))


def to_torch(state: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Checkpoint arrays as a state_dict: batch norm's counter back to a 0-d int64
    (checkpoints keep every tensor in the network's dtype, the counter as one row)."""
    return {key: (torch.tensor(int(np.asarray(value).reshape(-1)[0]), dtype=torch.int64)
                  if key.endswith(BUFFER_COUNTER) else torch.from_numpy(np.asarray(value)))
            for key, value in state.items()}


def to_arrays(state: dict[str, torch.Tensor], dtype: str) -> dict[str, np.ndarray]:
    """A state_dict as checkpoint arrays (`to_torch`'s inverse)."""
    return {key: (np.full(1, float(value), dtype=dtype) if key.endswith(BUFFER_COUNTER)
                  else value.detach().to("cpu").numpy().copy())
            for key, value in state.items()}


def initial_state(spec: NetworkSpec, seed: int) -> dict[str, np.ndarray]:
    """The initialisation under `seed` (PyTorch's, or torchvision's), as checkpoint
    arrays: parameters and batch norm's running statistics."""
    torch.manual_seed(seed)
    return to_arrays(build_network(spec).state_dict(), spec.dtype)


def load_model(spec: NetworkSpec, state: dict[str, np.ndarray]) -> SpecNetwork:
    """A plain-PyTorch network holding `state` (e.g. a checkpoint's), strictly."""
    model = build_network(spec)
    model.load_state_dict(to_torch(state))
    return model


def checkpoint_shapes(spec: NetworkSpec) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor's shape (parameters, running statistics, the counter as
    one row), without allocating them."""
    with torch.device("meta"):
        state = SpecNetwork(spec).state_dict()
    return {key: (1,) if key.endswith(BUFFER_COUNTER) else tuple(value.shape)
            for key, value in state.items()}


def checkpoint_row_chunks(spec: NetworkSpec, quanta: list[int]) -> dict[str, int]:
    """Each conv layer's tensors (and its batch norm's) at `quanta[l]` rows a chunk: the
    map from a layer's tensors to rows that a layout's `checkpoint_chunks` starts from
    (a kernel layout chunks them at its split's boundaries, tasks/layout.py)."""
    chunks = {}
    shapes = checkpoint_shapes(spec)
    for layer, quantum in zip(spec.conv, quanta):
        for prefix in (layer.name, layer.bn_name):
            for key in shapes:
                if prefix and key.startswith(prefix + ".") and \
                        not key.endswith(BUFFER_COUNTER):
                    chunks[key] = quantum
    return chunks
