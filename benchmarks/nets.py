"""The networks the benchmarks run, by name: each a shipped run config
(`python -m benchmarks.nets` lists them).

`small` and `paper` are the paper's family (configs/small.yaml, configs/paper.yaml);
`resnet20` and `vgg11` are zoo networks at a size two cores train in a few tenths of
a second a step (configs/resnet20.yaml; configs/vgg11.yaml, width 1/4 at 32x32).
"""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETS = {"paper": "configs/paper.yaml", "small": "configs/small.yaml",
        "resnet20": "configs/resnet20.yaml", "vgg11": "configs/vgg11.yaml"}


def net_path(net: str) -> str:
    """The absolute path of benchmark network `net`'s config."""
    return os.path.join(ROOT, NETS[net])


def main() -> None:
    """Print each benchmark network's name and config."""
    import argparse
    argparse.ArgumentParser(description="The networks the benchmarks take with --net, "
                            "and their configs.").parse_args()
    for name, path in NETS.items():
        print(f"{name:10s} {path}")


if __name__ == "__main__":
    main()
