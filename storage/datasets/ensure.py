"""Opening a run's dataset: reuse the store at a path if it fits the request, else build it.

Every run names its data as a source (``"synthetic"``, a folder of images or a
CIFAR-10 path) plus build arguments, not as a finished store, so that a fresh
checkout or a changed config just works. This module decides between reusing and rebuilding by comparing the
'build' attribute a store carries with the one the request would write, and
verifies a reused store whole before the run trusts it.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from storage.datasets.cifar10 import (CIFAR10_CLASSES, CIFAR10_IMAGE_SHAPE, cifar10_build,
                                      cifar10_fingerprint, import_cifar10, is_cifar10_folder)
from storage.datasets.image_folder import (folder_fingerprint, image_folder_build,
                                           image_folder_classes, import_image_folder)
from storage.datasets.integrity import verify_dataset
from storage.datasets.store import DatasetError, DatasetInfo, dataset_attrs, open_dataset_info
from storage.datasets.synthetic import create_synthetic_dataset, synthetic_build
from storage.datasets.writer import build_lock, check_dtype

log = logging.getLogger(__name__)


def source_kind(source: str, recorded: dict[str, Any] | None = None) -> str:
    """What `source` names: ``synthetic``, ``image_folder`` (a folder that does not hold
    CIFAR-10) or ``cifar10`` (its archive or folder). A source that is gone is what
    the store built from it (`recorded`, its 'build') says, else CIFAR-10's archive."""
    if source == "synthetic":
        return "synthetic"
    if os.path.isdir(source):
        return "cifar10" if is_cifar10_folder(source) else "image_folder"
    if not os.path.exists(source) and recorded and recorded.get("kind") == "image_folder" \
            and recorded.get("source") == os.path.abspath(source):
        return "image_folder"  # the store outlives the folder it was imported from
    return "cifar10"


def ensure_dataset(spec_source: str, path: str, **kwargs: Any) -> DatasetInfo:
    """Open the store at `path` if it was built from the same request, else build it.

    `spec_source` is ``"synthetic"`` (kwargs go to create_synthetic_dataset), a folder
    of images (import_image_folder; ``classes``, if given, must be its class count)
    or a path to CIFAR-10's archive or folder (import_cifar10; ``seed`` is ignored
    there and ``classes``/``image_shape`` must match CIFAR-10's). ``image_size`` is
    the images' side (None: 32; CIFAR-10's is 32). A store built from other
    arguments is rebuilt in place; a path holding anything other than a dataset store
    is never replaced. ``overwrite=True`` forces a rebuild. The decision, the check
    of a reused store and a build hold the path's build lock (`writer.build_lock`):
    a second process asking for the same store at once waits, saying so in one line
    to ``say`` (a callable taking a line, if given, which also hears of half-built
    stores removed), and then reuses the store.
    """
    kwargs = dict(kwargs)
    say = kwargs.pop("say", None)
    with build_lock(path, say):
        return _ensure(spec_source, path, kwargs, say or (lambda line: None))


def _ensure(spec_source: str, path: str, kwargs: dict[str, Any],
            say: Callable[[str], None]) -> DatasetInfo:
    """`ensure_dataset` under the store's build lock; a build, and why a store is
    built again in its place, are said to `say` (a build may take a while; a rebuild
    replaces what was there)."""
    overwrite = bool(kwargs.pop("overwrite", False))
    recorded = _recorded_build(path)
    kind = source_kind(spec_source, recorded)
    builder, args = _builder(kind, spec_source, path, kwargs)
    try:
        bound = inspect.signature(builder).bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"ensure_dataset({spec_source!r}): {exc}") from None
    bound.apply_defaults()
    wanted = _wanted_build(builder, bound.arguments, recorded)
    if not overwrite and os.path.lexists(path):
        if recorded == wanted:
            verify_dataset(path)
            return open_dataset_info(path)
        log.info("dataset store %s was built from %s, wanted %s: rebuilding", path,
                 recorded or "something else", wanted)
        if recorded is not None:
            say(f"dataset: building {path} again in its place: {build_change(recorded, wanted)}")
        overwrite = True  # check_target still refuses anything that is not ours
    log.info("building dataset store %s from %s", path, spec_source)
    bound.arguments["overwrite"] = overwrite
    with said_if_slow(say, f"dataset: building {path} from {spec_source}"):
        return builder(*bound.args, **bound.kwargs)


#: A build said once it has taken this long (a small one, a second or less, says
#: nothing: a line before a refusal would make bad input two lines).
ANNOUNCE_AFTER_S = 1.0


@contextlib.contextmanager
def said_if_slow(say: Callable[[str], None], doing: str) -> Iterator[None]:
    """``doing ...`` to `say` once the block has run `ANNOUNCE_AFTER_S`, and
    ``done (N s)`` when a block so announced ends without an error."""
    started, said = time.monotonic(), threading.Event()

    def announce() -> None:
        say(f"{doing} ...")
        said.set()

    timer = threading.Timer(ANNOUNCE_AFTER_S, announce)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()  # an announcement under way ends first
    if said.is_set():
        say(f"{doing}: done ({time.monotonic() - started:.1f} s)")


def build_change(recorded: dict[str, Any], wanted: dict[str, Any]) -> str:
    """How the build a run wants differs from the one a store records, in words:
    `source: /data/cifar-10-python.tar.gz -> synthetic`, `train_samples: 5000 -> 512`."""
    def value(build: dict[str, Any], key: str) -> Any:
        if key == "source" and "source" not in build:
            return build.get("kind")
        return build.get(key)

    if value(recorded, "source") != value(wanted, "source"):  # the rest follows from it
        return f"source: {value(recorded, 'source')} -> {value(wanted, 'source')}"
    keys = [key for key in dict.fromkeys([*recorded, *wanted])
            if key not in ("kind", "files") and value(recorded, key) != value(wanted, key)]
    words = [f"{key}: {value(recorded, key)} -> {value(wanted, key)}" for key in keys]
    if recorded.get("files") != wanted.get("files") and "files" in wanted:
        words.append("its source files changed")
    return "; ".join(words) or "built by other code"


def _recorded_build(path: str) -> dict[str, Any] | None:
    """The 'build' attribute of the store at `path`; None if there is no store of ours."""
    if not os.path.lexists(path):
        return None
    try:
        return dataset_attrs(path).get("build")
    except DatasetError:
        return None


def _builder(kind: str, source: str, path: str,
             kwargs: dict[str, Any]) -> tuple[Callable[..., DatasetInfo], tuple[str, ...]]:
    """The function that builds a store of `kind` and its positional arguments;
    `kwargs` are turned into its keywords (``image_size``, ``classes`` checked)."""
    image_size = kwargs.pop("image_size", None)
    if kind == "synthetic":
        if image_size is not None:
            kwargs["image_shape"] = (3, image_size, image_size)
        return create_synthetic_dataset, (path,)
    classes = kwargs.pop("classes", None)
    if kind == "image_folder":
        found = image_folder_classes(source) if os.path.isdir(source) else None
        if classes is not None and found is not None and classes != len(found):
            raise DatasetError(f"{classes} classes asked for, but the image folder {source!r} "
                               f"has {len(found)} ({', '.join(found)})")
        if image_size is not None:
            kwargs["image_size"] = image_size
        return import_image_folder, (source, path)
    kwargs.pop("seed", None)
    side = CIFAR10_IMAGE_SHAPE[1] if image_size is None else image_size
    if (classes or CIFAR10_CLASSES) != CIFAR10_CLASSES or side != CIFAR10_IMAGE_SHAPE[1] or \
            tuple(kwargs.pop("image_shape", CIFAR10_IMAGE_SHAPE)) != CIFAR10_IMAGE_SHAPE:
        raise ValueError(f"CIFAR-10 has {CIFAR10_CLASSES} classes of shape "
                         f"{CIFAR10_IMAGE_SHAPE}; got other classes/image_shape/image_size")
    return import_cifar10, (source, path)


def _wanted_build(builder: Callable[..., DatasetInfo], arguments: dict[str, Any],
                  recorded: dict[str, Any] | None) -> dict[str, Any]:
    """The 'build' attribute a store made from these arguments would carry (for an
    image folder or CIFAR-10 source that is gone, the files of the store it left,
    `recorded`)."""
    dtype = check_dtype(arguments["dtype"])
    if builder is create_synthetic_dataset:
        build = synthetic_build(arguments["train_samples"], arguments["test_samples"],
                                list(arguments["image_shape"]), arguments["classes"],
                                arguments["seed"], dtype)
    elif builder is import_image_folder:
        source = arguments["source"]
        files = folder_fingerprint(source) if os.path.isdir(source) else \
            (recorded or {}).get("files", "")
        build = image_folder_build(source, arguments["image_size"],
                                   arguments["train_samples"], arguments["test_samples"],
                                   arguments["seed"], dtype, files)
    else:
        source = arguments["source"]
        files = cifar10_fingerprint(source) if os.path.exists(source) else \
            (recorded or {}).get("files", "")
        build = cifar10_build(source, arguments["train_samples"], arguments["test_samples"],
                              dtype, files)
    return json.loads(json.dumps(build))  # the form it takes after a round trip as attrs
