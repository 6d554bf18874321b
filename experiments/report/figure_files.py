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


def write_figures(makers: list[tuple[str, Any]], out_dir: str) -> list[str]:
    """Draw each (file name, maker) figure into `out_dir`; a maker returns False when
    its figure does not apply (nothing is written then). Returns the names drawn. The
    folder holds no earlier report by now (report_folder.prepare_report_folder)."""
    return [name for name, make in makers if make(os.path.join(out_dir, name))]
