"""Training: the engine (the one setup and the one step), the run in phases, checkpoints, output,
the memory plan, signals and injected faults."""
