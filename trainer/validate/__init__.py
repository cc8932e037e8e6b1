"""Validate a resolved config before any worker starts: schema, structure, and the model-aware checks."""
