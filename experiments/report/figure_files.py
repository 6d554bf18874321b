"""Writing the reports' figures: one layout and save, one loop over figure makers."""

from __future__ import annotations

import os
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def legend_beside(fig: Any, axes: Any) -> None:
    """One legend for the figure, right of its panels: every label drawn on `axes`,
    once each, in the order first drawn."""
    handles: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(list(handles.values()), list(handles), loc="center left",
               bbox_to_anchor=(1.0, 0.5), fontsize=8)


def save_figure(fig: Any, path: str) -> None:
    """Lay out, write and close a figure (every figure of the reports)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


#: Figures named after what a store holds (`growth_<strategy>.png`, a scaling report's
#: `winner_<network>.png`): an earlier report's that this one does not draw are removed.
NAMED_BY_DATA = ("growth_", "winner_")


def write_figures(makers: list[tuple[str, Any]], out_dir: str) -> list[str]:
    """Draw each (file name, maker) figure; a maker returns False when its figure does
    not apply, and an earlier report's file of that name is then removed, as is one of
    `NAMED_BY_DATA` that no maker drew (a strategy or network the store no longer has)."""
    written = []
    for name, make in makers:
        path = os.path.join(out_dir, name)
        if make(path):
            written.append(name)
        elif os.path.exists(path):
            os.remove(path)
    for name in os.listdir(out_dir):
        if name.startswith(NAMED_BY_DATA) and name.endswith(".png") and name not in written:
            os.remove(os.path.join(out_dir, name))
    return written
