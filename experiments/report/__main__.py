"""`python -m experiments.report`: see experiments.report.cli.cli."""

import sys

from experiments.report.cli.cli import main

sys.exit(main())
