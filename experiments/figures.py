"""Writing the reports' figures: one layout and save, one loop over figure makers."""

from __future__ import annotations

import os
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save_figure(fig: Any, path: str) -> None:
    """Lay out, write and close a figure (every figure of the reports)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_figures(makers: list[tuple[str, Any]], out_dir: str) -> list[str]:
    """Draw each (file name, maker) figure; a maker returns False when its figure does
    not apply, and an earlier report's file of that name is then removed."""
    written = []
    for name, make in makers:
        path = os.path.join(out_dir, name)
        if make(path):
            written.append(name)
        elif os.path.exists(path):
            os.remove(path)
    return written
