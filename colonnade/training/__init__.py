"""The training step, loop, evaluation and logging."""
