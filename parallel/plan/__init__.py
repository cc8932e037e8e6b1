"""The parallel plan: a config's mesh and parallel sections resolved against one model, without a process group."""
