"""A step forecast: what prices a layout (this host's calibration or a hardware profile) and the dry run's prediction
(plan.json)."""
