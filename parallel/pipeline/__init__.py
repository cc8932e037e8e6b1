"""Pipeline parallelism on torch.distributed.pipelining: stage modules, schedules, the order of actions, activations
across stage boundaries and the measured timeline."""
