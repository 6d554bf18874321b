"""Predict-only sweeps (`mode: scaling`) and their hardware presets."""
