"""The planner: a config's memory and step time predicted before any worker starts (the dry run), the host's
calibration, and the search behind ``+parallel=auto``."""
