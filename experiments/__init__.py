"""What to run and what it means: sweeps of trainings and their results.

- `experiments.sweep_config`: the sweep file (a base run config plus axes, zip
  groups, repeats, the timing protocol) expanded into validated points;
- `experiments.sweep`: ``python -m experiments.sweep`` runs the points on a Dask
  cluster (or embedded ones) and writes them to one Zarr store, resumably;
- `experiments.results`: that store's layout, lock and per-point writes;
- `experiments.report`: ``python -m experiments.report`` turns a store into
  figures and a markdown table;
- `experiments.prediction`: the performance model's prediction for a point.
"""
