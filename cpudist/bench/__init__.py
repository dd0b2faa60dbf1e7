"""Measurement: presets, FLOP/MFU figures, the bench of the engine's own step, peers, scaling."""
