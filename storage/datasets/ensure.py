"""Opening a run's dataset: reuse the store at a path if it fits the request, else build it.

Every run names its data as a source (``"synthetic"`` or a CIFAR-10 path) plus build
arguments, not as a finished store, so that a fresh checkout or a changed config
just works. This module decides between reusing and rebuilding by comparing the
'build' attribute a store carries with the one the request would write, and
verifies a reused store whole before the run trusts it.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from storage.datasets.cifar10 import (CIFAR10_CLASSES, CIFAR10_IMAGE_SHAPE, cifar10_build,
                                      import_cifar10)
from storage.datasets.integrity import verify_dataset
from storage.datasets.store import DatasetError, DatasetInfo, dataset_attrs, open_dataset_info
from storage.datasets.synthetic import create_synthetic_dataset, synthetic_build
from storage.datasets.writer import check_dtype

log = logging.getLogger(__name__)


def ensure_dataset(spec_source: str, path: str, **kwargs: Any) -> DatasetInfo:
    """Open the store at `path` if it was built from the same request, else build it.

    `spec_source` is ``"synthetic"`` (kwargs go to create_synthetic_dataset) or a path
    to CIFAR-10's archive or folder (kwargs go to import_cifar10; ``seed`` is
    ignored there and ``classes``/``image_shape`` must match CIFAR-10's). A store
    built from other arguments is rebuilt in place; a path holding anything other
    than a dataset store is never replaced. ``overwrite=True`` forces a rebuild.
    Call this once (on the master): concurrent builders of one path would race.
    """
    kwargs = dict(kwargs)
    overwrite = bool(kwargs.pop("overwrite", False))
    if spec_source == "synthetic":
        builder: Callable[..., DatasetInfo] = create_synthetic_dataset
        args: tuple[str, ...] = (path,)
    else:
        kwargs.pop("seed", None)
        if kwargs.pop("classes", CIFAR10_CLASSES) != CIFAR10_CLASSES or tuple(
                kwargs.pop("image_shape", CIFAR10_IMAGE_SHAPE)) != CIFAR10_IMAGE_SHAPE:
            raise ValueError(f"CIFAR-10 has {CIFAR10_CLASSES} classes of shape "
                             f"{CIFAR10_IMAGE_SHAPE}; got other classes/image_shape")
        builder, args = import_cifar10, (spec_source, path)
    try:
        bound = inspect.signature(builder).bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"ensure_dataset({spec_source!r}): {exc}") from None
    bound.apply_defaults()
    wanted = _wanted_build(builder, bound.arguments)
    if not overwrite and os.path.lexists(path):
        try:
            attrs = dataset_attrs(path)
        except DatasetError:
            attrs = None
        if attrs is not None and attrs.get("build") == wanted:
            verify_dataset(path)
            return open_dataset_info(path)
        log.info("dataset store %s was built from %s, wanted %s: rebuilding", path,
                 attrs.get("build") if attrs else "something else", wanted)
        overwrite = True  # check_target still refuses anything that is not ours
    log.info("building dataset store %s from %s", path, spec_source)
    bound.arguments["overwrite"] = overwrite
    return builder(*bound.args, **bound.kwargs)


def _wanted_build(builder: Callable[..., DatasetInfo], arguments: dict[str, Any]) -> dict[str, Any]:
    """The 'build' attribute a store made from these arguments would carry."""
    if builder is create_synthetic_dataset:
        build = synthetic_build(arguments["train_samples"], arguments["test_samples"],
                                list(arguments["image_shape"]), arguments["classes"],
                                arguments["seed"], check_dtype(arguments["dtype"]))
    else:
        build = cifar10_build(arguments["train_samples"], arguments["test_samples"],
                              check_dtype(arguments["dtype"]))
    return json.loads(json.dumps(build))  # the form it takes after a round trip as attrs
