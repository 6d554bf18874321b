"""`python -m experiments.report`: see experiments.report.cli."""

import sys

from pipeline.cli import quiet_start

with quiet_start():  # xarray, matplotlib: a Ctrl-C meanwhile is one line, not a traceback
    from experiments.report.cli import main

sys.exit(main())
