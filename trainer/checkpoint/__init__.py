"""Checkpoints: atomic, sharding-aware saves and loads of a run's model, optimizer and progress on DCP."""
