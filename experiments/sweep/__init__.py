"""Measured sweeps: `python -m experiments.sweep CONFIG`."""
