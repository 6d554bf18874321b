"""Checksums of a sweep's results store: recorded as each point's write lands, verified
when a sweep resumes and when a report opens the store.

A sweep store holds the results people publish, so a chunk deleted or flipped on disk
must never read as a finished point. Why per point: a measured sweep's store keeps
every per-point variable one point to a chunk file (``step_time/c/<i>/<j>/<repeat>``;
a series' file holds all its steps), so a chunk file's key names its point. Each
point's write records the CRC-32C and size of every chunk file it left, and of the
status file it is about to write, in ``checksums.json`` inside the store (one atomic
replace), then writes its status: a point counts as done only when every file the
record lists for it is there and intact, and no other file of it is. Damage thus
costs one point, which a resumed sweep runs again; a report names it and stops.

The record's parts:

- ``fixed``: files written once, with the store: every array's ``zarr.json`` and the
  coordinates (a ``mode: scaling`` store, rewritten whole by every run, lists all its
  files here). Damage here is not a point's: it is named, and the store is refused.
- ``derived``: the chunk files of ``speedup`` and ``efficiency``, which every point's
  write recomputes over the whole grid from the points' figures.
- ``points``: per point key (its chunk indices, ``"0/1/0"``), its status and files.

The root ``zarr.json`` (attributes, rewritten at each session's end) is not in the
record: it must parse, which is checked first. CRC-32C detects flipped bits, torn and
missing files, not deliberate tampering (storage/checksums.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zarr

from storage.checksums import ALGORITHM, crc32c
from storage.space import replace_file

RECORD = "checksums.json"
RECORD_KIND = "hetcnn-sweep-checksums/1"
METADATA = "zarr.json"
#: A status file without its record, or a record without its status file, is also
#: what a sweep stopped in the milliseconds between the two leaves.
STOPPED_WRITING = "(damaged, or a sweep stopped while writing the point)"


class StoreDamaged(Exception):
    """The store's metadata, coordinates or record is damaged: no point can be trusted
    to be read (one line naming the file)."""


@dataclass(frozen=True)
class Damage:
    """One damaged file: its path in the store and what is wrong with it."""

    file: str
    problem: str

    def __str__(self) -> str:
        return f"{self.file} {self.problem}"


@dataclass
class Verification:
    """What `verify` found: each point's status as recorded (damaged points pending),
    the damaged points by key, and the first damage to the derived variables."""

    status: np.ndarray
    damaged: dict[str, Damage] = field(default_factory=dict)
    derived: Damage | None = None

    @property
    def intact(self) -> bool:
        return not self.damaged and self.derived is None


def _read_json(path: str) -> Any:
    """A JSON file of the store, or StoreDamaged naming it (missing, or not JSON)."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise StoreDamaged(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise StoreDamaged(f"{path} is not valid JSON ({error})") from None


def read_metadata(path: str) -> dict[str, Any]:
    """A ``zarr.json`` parsed, or StoreDamaged naming it."""
    meta = _read_json(path)
    if not isinstance(meta, dict) or "node_type" not in meta:
        raise StoreDamaged(f"{path} is not Zarr metadata (no node_type)")
    return meta


def point_key(region: tuple[int, ...]) -> str:
    return "/".join(str(int(i)) for i in region)


def _relative_files(root: str) -> list[str]:
    """Every file under `root`, relative to it with '/', but Zarr's half-written
    ``*.partial`` files (a kill inside a write leaves one; it was never the chunk).
    Paths are joined as text: a store holds thousands of small files, and
    os.path.relpath per file cost more than reading them."""
    found = []
    root = os.path.normpath(root)
    for folder, _dirs, files in os.walk(root):
        below = folder[len(root) + 1:]  # "" for `root` itself
        prefix = below + "/" if below else ""
        found.extend(prefix + name for name in files if not name.endswith(".partial"))
    return found


def _crc(root: str, relative: str) -> list[int]:
    """[CRC-32C, size] of a file of the store (chunk and metadata files are small:
    read whole)."""
    with open(f"{root}/{relative}", "rb") as handle:
        content = handle.read()
    return [crc32c(content), len(content)]


def encoded_chunk(array_dir: str, value: Any) -> bytes:
    """The bytes Zarr writes for one chunk of the array at `array_dir` holding `value`
    everywhere: the array's own codecs, applied to a scratch copy (so a point's status
    file can be recorded before it is written)."""
    meta = read_metadata(os.path.join(array_dir, METADATA))
    chunk_shape = meta["chunk_grid"]["configuration"]["chunk_shape"]
    meta["shape"] = chunk_shape
    with tempfile.TemporaryDirectory(prefix="hetcnn-chunk-") as scratch:
        with open(os.path.join(scratch, METADATA), "w", encoding="utf-8") as handle:
            json.dump(meta, handle)
        zarr.open_array(scratch, mode="r+")[...] = value
        files = _relative_files(scratch)
        files.remove(METADATA)
        if not files:  # the fill value: Zarr writes no chunk
            return b""
        with open(os.path.join(scratch, *files[0].split("/")), "rb") as handle:
            return handle.read()


def record_whole_store(path: str) -> None:
    """Checksums of a store written whole (``mode: scaling``): every file is `fixed`."""
    Checksums.new(path, "scaling", [], [], [], {}).save()


class Checksums:
    """The record of one store (``<store>/checksums.json``), held in memory by the one
    sweep writing the store (it holds the store's lock) and saved at each change."""

    def __init__(self, root: str, data: dict[str, Any]) -> None:
        self.root = root
        self.data = data

    @classmethod
    def new(cls, root: str, mode: str, point_variables: list[str],
            derived_variables: list[str], dims: list[str],
            labels: dict[str, list[str]]) -> "Checksums":
        """An empty record for a store just written; `fixed` lists its files so far."""
        record = cls(root, {"kind": RECORD_KIND, "algorithm": ALGORITHM, "mode": mode,
                            "dims": dims, "labels": labels,
                            "point_variables": point_variables,
                            "derived_variables": derived_variables,
                            "fixed": {}, "derived": {}, "points": {}})
        record.data["fixed"] = {f: _crc(root, f) for f in record._scan()[0]}
        return record

    @classmethod
    def load(cls, root: str) -> "Checksums":
        path = os.path.join(root, RECORD)
        data = _read_json(path)
        if not isinstance(data, dict) or data.get("kind") != RECORD_KIND or \
                data.get("algorithm") != ALGORITHM:
            raise StoreDamaged(f"{path} is not a {RECORD_KIND} record of {ALGORITHM} "
                               "checksums")
        return cls(root, data)

    @staticmethod
    def is_record(root: str) -> bool:
        """Whether `root` holds a readable record: the store is a sweep's, even if its
        root metadata is not."""
        try:
            Checksums.load(root)
        except StoreDamaged:
            return False
        return True

    def save(self) -> None:
        replace_file(os.path.join(self.root, RECORD),
                     json.dumps(self.data, separators=(",", ":")))

    # Writing -------------------------------------------------------------------------

    def _point_paths(self, key: str) -> list[str]:
        return [os.path.join(self.root, name, "c", *key.split("/"))
                for name in self.data["point_variables"]]

    def forget_point(self, region: tuple[int, ...]) -> None:
        """Before a point is (re)written: drop its entry, then its files, so that a
        sweep stopped from here on leaves it pending, not damaged."""
        key = point_key(region)
        if self.data["points"].pop(key, None) is not None:
            self.save()
        for path in self._point_paths(key):
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)

    def record_point(self, region: tuple[int, ...], status: int,
                     status_file: tuple[str, bytes]) -> None:
        """After the point's figures landed, before its status is written: its files
        as they are, and its status file (`status_file`: path, bytes) as it will be."""
        key = point_key(region)
        files = {}
        for path in self._point_paths(key):
            relative = os.path.relpath(path, self.root).replace(os.sep, "/")
            if os.path.isdir(path):
                files.update({f"{relative}/{f}": _crc(self.root, f"{relative}/{f}")
                              for f in _relative_files(path)})
            elif os.path.exists(path):
                files[relative] = _crc(self.root, relative)
        name, content = status_file
        if content:
            files[f"{name}/c/{key}"] = [crc32c(content), len(content)]
        self.data["points"][key] = {"status": int(status), "files": files}
        self.save()

    def record_derived(self) -> None:
        """After speedup and efficiency were recomputed over the grid."""
        files = [f"{name}/{f}" for name in self.data["derived_variables"]
                 for f in _relative_files(os.path.join(self.root, name))
                 if f.startswith("c/")]
        self.data["derived"] = {f: _crc(self.root, f) for f in files}
        self.save()

    # Verifying -----------------------------------------------------------------------

    def _scan(self) -> tuple[list[str], list[str], dict[str, set[str]]]:
        """The store's files by part: fixed, derived, and per point key."""
        points, derived = set(self.data["point_variables"]), \
            set(self.data["derived_variables"])
        ndim = len(self.data["dims"])
        fixed, derived_files, by_point = [], [], {}
        for relative in _relative_files(self.root):
            parts = relative.split("/")
            if relative in (METADATA, RECORD):
                continue
            if len(parts) > 2 and parts[1] == "c" and parts[0] in points:
                by_point.setdefault("/".join(parts[2:2 + ndim]), set()).add(relative)
            elif len(parts) > 2 and parts[1] == "c" and parts[0] in derived:
                derived_files.append(relative)
            else:
                fixed.append(relative)
        return fixed, derived_files, by_point

    def _compare(self, expected: dict[str, list[int]], present: set[str]) -> Damage | None:
        """The first difference between recorded files and those on disk."""
        for relative in sorted(expected):
            if relative not in present:
                return Damage(relative, "is missing")
            if _crc(self.root, relative) != list(expected[relative]):
                return Damage(relative, f"fails its {ALGORITHM} checksum")
        extra = sorted(present - set(expected))
        if extra:
            return Damage(extra[0], "was not written by the sweep (no checksum recorded)")
        return None

    def verify(self) -> Verification:
        """Check every file of the store against the record. StoreDamaged for damage to
        metadata or coordinates; damaged points and derived files are returned."""
        fixed, derived, by_point = self._scan()
        for relative in sorted(f for f in self.data["fixed"] if f.endswith(METADATA)):
            read_metadata(os.path.join(self.root, *relative.split("/")))  # names bad JSON
        damage = self._compare(self.data["fixed"], set(fixed))
        if damage is not None:
            raise StoreDamaged(f"{os.path.join(self.root, damage.file)} "
                               f"{damage.problem}")
        shape = tuple(len(self.data["labels"][d]) for d in self.data["dims"])
        result = Verification(np.zeros(shape, dtype=np.int8))
        result.derived = self._compare(self.data["derived"], set(derived))
        for key in sorted(set(self.data["points"]) | set(by_point)):
            entry = self.data["points"].get(key)
            present = by_point.get(key, set())
            status_file = f"status/c/{key}"
            if entry is None:
                if status_file in present:  # a status no write recorded
                    result.damaged[key] = Damage(status_file, "has no recorded checksum "
                                                 f"{STOPPED_WRITING}")
                continue  # else leftovers of a write stopped before its record: pending
            damage = self._compare(entry["files"], present)
            if damage == Damage(status_file, "is missing"):
                damage = Damage(status_file, f"is missing {STOPPED_WRITING}")
            if damage is not None:
                result.damaged[key] = damage
            else:
                result.status[tuple(int(i) for i in key.split("/"))] = entry["status"]
        return result

    def describe(self, key: str) -> str:
        """A point by its coordinates: ``batch=8, repeat=0``."""
        return ", ".join(f"{dim}={self.data['labels'][dim][int(index)]}"
                         for dim, index in zip(self.data["dims"], key.split("/")))
