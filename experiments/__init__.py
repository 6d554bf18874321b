"""What to run and what it means: sweeps of trainings and their results.

- `experiments.sweep.config`: the sweep file (a base run config plus axes, zip
  groups, repeats, the timing protocol), read and checked by `load_sweep`;
- `experiments.sweep.axes`: its axes and zip groups parsed into the grid's dims,
  with the coordinate labels of their values (shared with scaling sweeps);
- `experiments.sweep.points`: the grid's points and their rules (strategy fit,
  the cluster each needs, run order);
- `experiments.sweep.cli`: ``python -m experiments.sweep``, the command line;
- `experiments.sweep.run`: runs the points on a Dask cluster (or embedded ones)
  into one Zarr store, resumably; `experiments.sweep.measure`: one point's figures;
- `experiments.sweep.store_layout`, `experiments.sweep.results`: that store's layout; its lock and per-point writes;
  `experiments.sweep.speedup`: its speedup/efficiency baseline;
  `experiments.sweep.provenance`: the machine and code revision it records;
  `experiments.sweep.summary`: a store read back as a table;
- `experiments.report.cli`: ``python -m experiments.report`` turns a store into
  figures (`report_figures`, `report_strategies`, over `report_view`) and
  report.md (`report_markdown`); scaling stores go to `experiments.scaling.report`
  (over `scaling_view`);
- `experiments.scaling.config`, `experiments.scaling.run`, `experiments.scaling.hardware`:
  predict-only sweeps over hypothetical clusters (``mode: scaling``).
"""
