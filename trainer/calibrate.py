"""``python -m trainer.calibrate mesh=[8] [--force]``: the host's calibration (probed once, cached).
The command's home; the probes live in :mod:`trainer.planner.calibration.probe`."""

from trainer.planner.calibration.probe import main

if __name__ == "__main__":
    main()
