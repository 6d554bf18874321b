"""What to run and what it means: sweeps of trainings and their results.

- `experiments.sweep_config`: the sweep file (a base run config plus axes, zip
  groups, repeats, the timing protocol), read and checked by `load_sweep`;
- `experiments.sweep_axes`: its axes and zip groups parsed into the grid's dims,
  with the coordinate labels of their values (shared with scaling sweeps);
- `experiments.sweep_points`: the grid's points and their rules (strategy fit,
  the cluster each needs, run order);
- `experiments.sweep`: ``python -m experiments.sweep``, the command line;
- `experiments.sweep_run`: runs the points on a Dask cluster (or embedded ones)
  into one Zarr store, resumably; `experiments.measure`: one point's figures;
- `experiments.results`: that store's layout, lock and per-point writes;
  `experiments.speedup`: its speedup/efficiency baseline;
  `experiments.provenance`: the machine and code revision it records;
  `experiments.summary`: a store read back as a table;
- `experiments.report`: ``python -m experiments.report`` turns a store into
  figures (`report_figures`, `report_strategies`, over `report_view`) and
  report.md (`report_markdown`); scaling stores go to `experiments.scaling_report`
  (over `scaling_view`);
- `experiments.scaling_config`, `experiments.scaling`, `experiments.hardware`:
  predict-only sweeps over hypothetical clusters (``mode: scaling``).
"""
