"""How parameters are sharded on a mesh: tensor (and sequence) parallel, data parallel (DDP, FSDP2, HSDP), activation
checkpointing and per-block compile."""
