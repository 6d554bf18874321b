"""``python -m storage.datasets verify PATH``: check a dataset store whole, from a shell.

Lets an operator (or a script) test a store on disk without starting a run: the exit
status tells a damaged store (1) from a path that is no store of this format (2).
"""

from __future__ import annotations

import argparse
import sys

from storage.datasets.integrity import verify_dataset
from storage.datasets.store import DatasetDamaged, DatasetError


def main(argv: list[str] | None = None) -> int:
    """``python -m storage.datasets verify PATH``: check a store whole.

    Exit 0 if every chunk matches its checksum and the labels are in range, 1 if the
    store is damaged, 2 if PATH is not a dataset store of this format.
    """
    parser = argparse.ArgumentParser(prog="python -m storage.datasets",
                                     description="Check a dataset store against the "
                                                 "checksums recorded when it was built.")
    parser.add_argument("command", choices=["verify"])
    parser.add_argument("path", help="the dataset store (a directory)")
    args = parser.parse_args(argv)
    try:
        report = verify_dataset(args.path)
    except DatasetError as error:  # damaged: 1; not a store of this format: 2
        print(f"error: {error}", file=sys.stderr)
        return 1 if isinstance(error, DatasetDamaged) else 2
    print(f"{args.path}: ok ({report.arrays} arrays, {report.files} chunk files, "
          f"{report.bytes / 1e6:.1f} MB checked in {report.seconds:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
