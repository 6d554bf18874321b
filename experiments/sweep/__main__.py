"""`python -m experiments.sweep`: see experiments.sweep.cli."""

from pipeline.cli import exit_with, quiet_start

with quiet_start():  # torch, Dask, xarray: a Ctrl-C meanwhile is one line, not a traceback
    from experiments.sweep.cli import main

exit_with(main())
