"""Reports of sweep stores: `python -m experiments.report STORE`."""
