"""Training: the RL step, the loop, SFT warm start, checkpoints, metrics."""
