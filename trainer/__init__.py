"""Meshflow trainer: compose -> validate -> launch workers -> train. Run: ``python -m trainer``."""
