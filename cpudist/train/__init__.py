"""Training: the engine (the one setup), the loop, evaluation, checkpoints, output, faults."""
