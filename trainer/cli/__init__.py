"""The command line: ``python -m trainer`` (compose -> validate -> launch), its ``--help`` and Hydra sweeps."""
