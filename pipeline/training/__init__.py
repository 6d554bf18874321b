"""One training run around the engine: the loop, recovery from lost workers, the in-process reference, the output directory, evaluation."""
