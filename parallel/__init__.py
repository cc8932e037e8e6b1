"""The distribution engine: meshes, placements, stages, schedules, FSDP. Knows nothing of training loops."""
