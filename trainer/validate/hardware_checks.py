"""The ``hardware`` section's checks: a GPU profile states every number the planner reads, a run
that is not a dry run has that hardware, and ``launch.nnodes`` nodes of the profile hold the mesh."""

from __future__ import annotations

from parallel.errors import ConfigIssue
from trainer.config.schema import RunConfig

_PROFILE_EXAMPLES = {  # the fix of a GPU profile's missing key, an H100 SXM's value as the example
    "devices_per_node": "hardware.devices_per_node=8", "memory_gb": "hardware.memory_gb=80",
    "memory_bandwidth_gb_s": "hardware.memory_bandwidth_gb_s=3350",
    "peak_tflops.bf16": "hardware.peak_tflops.bf16=989.5", "peak_tflops.fp32": "hardware.peak_tflops.fp32=67",
    "intra_node": "'hardware.intra_node={bandwidth_gb_s: 370.8, latency_us: 3.4, source: datasheet}'",
    "inter_node": "'hardware.inter_node={bandwidth_gb_s: 50, latency_us: 14, source: datasheet}'",
    "runtime_memory": "'hardware.runtime_memory={cuda_context_gib: 0.7, nccl_gib: 1.0, allocator_slack: 0.1, "
                      "source: estimate}'",
    "sm_count": "hardware.sm_count=132",
    "achieved": "'hardware.achieved={matmul: 0.79, attention_forward: 0.49, attention_backward: 0.37, memory: 0.88, "
                "kernel_us: 11.1, source: measured}'",
}


def plans_elsewhere(cfg: RunConfig) -> bool:
    """A dry run for a GPU profile: it plans a cluster that need not be this host, so it needs no
    device, rendezvous or GPU here."""
    return cfg.dry_run and cfg.hardware.device == "cuda" and not cfg.hardware.is_host


def check_hardware(cfg: RunConfig) -> list[ConfigIssue]:
    """``hardware``: a GPU profile states every number the planner reads; a run that is not a dry run
    has that hardware; ``launch.nnodes`` nodes of the profile hold the mesh."""
    hw = cfg.hardware
    issues: list[ConfigIssue] = []
    if hw.device != "cuda" or hw.is_host:
        return issues
    for key in hw.missing_gpu_keys():
        issues.append(ConfigIssue(f"hardware.{key}", f"profile {hw.name!r} is a cuda profile and states no {key}; "
                                  "the planner prices the run with it",
                                  "state your hardware's value in the profile; an H100 SXM's is "
                                  f"{_PROFILE_EXAMPLES[key]}"))
    if not cfg.dry_run:
        import torch

        if not torch.cuda.is_available():
            issues.append(ConfigIssue("hardware", f"profile {hw.name!r} describes cuda devices, but no CUDA device is "
                                      "visible here and this is not a dry run", "add dry_run=true to plan it, or run "
                                      "on that hardware"))
    per_node, nnodes = cfg.world_size // cfg.launch.nnodes, cfg.launch.nnodes
    if hw.devices_per_node is not None and cfg.world_size % nnodes == 0 and per_node > hw.devices_per_node:
        fewest = next(n for n in range(-(-cfg.world_size // hw.devices_per_node), cfg.world_size + 1)
                      if cfg.world_size % n == 0)
        issues.append(ConfigIssue("launch.nnodes", f"{cfg.world_size} workers on {nnodes} node(s) is {per_node} per "
                                  f"node, but one {hw.name} node holds {hw.devices_per_node} devices",
                                  f"use launch.nnodes={fewest} ({cfg.world_size // fewest} per node), or more nodes "
                                  "dividing the world size"))
    return issues
