"""A layout's optimizer-step time from the model's work and the calibration: compute, communication and the measured
fixed costs."""
