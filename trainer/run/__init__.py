"""What every worker runs: the training loop, its checkpoints and its metrics."""
