"""Experiment tracking: the MLflow tracker and its null object, what a run records about itself, and its pictures."""
