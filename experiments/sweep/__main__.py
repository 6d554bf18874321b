"""`python -m experiments.sweep`: see experiments.sweep.cli."""

from experiments.sweep.cli import main
from pipeline.cli import exit_with

exit_with(main())
