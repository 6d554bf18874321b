"""`python -m experiments.report`: see experiments.report.cli."""

import sys

from experiments.report.cli import main

sys.exit(main())
