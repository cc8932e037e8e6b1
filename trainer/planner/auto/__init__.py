"""``+parallel=auto``: enumerate the valid layouts of N ranks, predict each, rank them and pick the fastest that
fits."""
