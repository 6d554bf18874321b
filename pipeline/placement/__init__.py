"""Who computes what: the strategy choice, calibration, the model's split, memory capacity and fitting."""
