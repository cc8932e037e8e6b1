"""Per-rank peak memory before any worker starts: the meta pass, what a layout adds, the host's overheads and the budget
check."""
