"""The host's calibration: how fast its workers compute and communicate, probed once and cached."""
