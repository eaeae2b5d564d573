"""Training: data pipeline, loop, checkpoints."""
