"""`python -m experiments.sweep`: see experiments.sweep.cli.cli."""

from experiments.sweep.cli.cli import main
from pipeline.cli import exit_with

exit_with(main())
