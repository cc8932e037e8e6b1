"""Validation of ``parallel.tensor_parallel_3d`` (Colossal-AI's 3-D tensor parallelism, ``+parallel=tp3d``): what
the cube needs of the config, before any model is built. What it needs of the model (a cube mesh, widths that
split, no biases) is checked where the plan is resolved (:mod:`parallel.plan.cube`).

* the three axes are named in ``parallel.dims`` and no other role takes them;
* each data-parallel rank's micro-batch splits its rows over q^2 ranks (rows over a, then b or c);
* what the cube is not built with is refused with a fix that works as printed: FSDP2 modes (the cube's
  weights are DTensors of three placements, more than FSDP2 takes), a pipeline, context or expert
  parallelism, the Megatron plan or placements beside it, packed documents, LoRA, torch.compile, bf16.
"""

from __future__ import annotations

from parallel.errors import ConfigIssue, override
from trainer.config.schema import RunConfig

PATH = "parallel.tensor_parallel_3d"


def cube_axes(cfg: RunConfig) -> list[str]:
    """The cube's axis names (none without the section): roles for the axis-usage check."""
    par = cfg.parallel
    cube = getattr(par, "tensor_parallel_3d", None) if par is not None else None
    return list(cube.dims) if cube is not None else []


def check_cube(cfg: RunConfig) -> list[ConfigIssue]:
    """The config's side of the cube (no model needed); empty without ``parallel.tensor_parallel_3d``."""
    par = cfg.parallel
    axes = cube_axes(cfg)
    if par is None or not axes or cfg.mesh is None or len(par.dims) != len(cfg.mesh_shape):
        return []
    issues = [ConfigIssue(f"{PATH}.dims", f"axis {name!r} is not in parallel.dims {par.dims}",
                          f"use three of {par.dims}, or add it to parallel.dims")
              for name in axes if name not in par.dims]
    if len(set(axes)) != 3:
        issues.append(ConfigIssue(f"{PATH}.dims", f"names an axis twice: {axes}", "name three different axes"))
    if issues:
        return issues
    dp = par.data_parallel
    taken = set(dp.dim_names) if dp is not None else set()
    for section in ("pipeline", "context_parallel", "expert_parallel", "tensor_parallel"):
        value = getattr(par, section)
        if value is not None:
            issues.append(ConfigIssue(f"parallel.{section}", f"{section.replace('_', ' ')} beside 3-D tensor "
                                      "parallelism is not built: the cube holds the whole model's blocks on one mesh",
                                      f"drop it: {override(f'parallel.{section}', None)}"))
    if taken & set(axes):
        issues.append(ConfigIssue("parallel.data_parallel.dim", f"axes {sorted(taken & set(axes))} are the cube's",
                                  "give data parallelism its own mesh axis"))
    if par.placements or par.layouts:
        key = "parallel.placements" if par.placements else "parallel.layouts"
        issues.append(ConfigIssue(key, "explicit placements or layouts beside the cube: the cube places the "
                                  "blocks itself", f"drop them: ~{key}"))
    if dp is not None and dp.mode != "ddp":
        issues.append(ConfigIssue("parallel.data_parallel.mode", f"{dp.mode} shards parameters with FSDP2, which takes "
                                  "DTensor parameters of at most two placements; a cube weight has three (and one "
                                  "more over dp)",
                                  f"replicate over dp: {override('parallel.data_parallel.mode', 'ddp')}"))
    issues += _check_rows(cfg, axes)
    issues += _check_extras(cfg)
    return issues


def _check_rows(cfg: RunConfig, axes: list[str]) -> list[ConfigIssue]:
    """Each data-parallel rank's micro-batch (its rows) splits over q^2 cube ranks."""
    side = cfg.axis_size(axes[0])
    dp = max(1, cfg.dp_size)
    rows = cfg.train.global_batch_size // cfg.train.grad_accum // dp
    if side <= 1 or rows % (side * side) == 0:
        return []
    fit = side * side * dp * cfg.train.grad_accum
    fit *= max(1, cfg.train.global_batch_size // fit)
    return [ConfigIssue("train.global_batch_size", f"each data-parallel rank's micro-batch has {rows} rows, which "
                        f"do not split over the cube's {side} x {side} row blocks (rows over a, then b or c)",
                        f"use a multiple of {side * side * dp * cfg.train.grad_accum}: "
                        f"{override('train.global_batch_size', fit)}")]


def _check_extras(cfg: RunConfig) -> list[ConfigIssue]:
    issues = []
    if getattr(cfg.data, "packing", False):
        issues.append(ConfigIssue("data.packing", "packed documents give attention per-row positions, which the "
                                  "cube's row blocks do not carry", f"{override('data.packing', False)}"))
    lora = getattr(cfg.model, "lora", None)
    if lora is not None and getattr(lora, "enabled", False):
        issues.append(ConfigIssue("model.lora", "LoRA adapters on 3-D Linears are not built",
                                  f"train without them: {override('model.lora.rank', 0)}"))
    if cfg.train.compile:
        issues.append(ConfigIssue("train.compile", "torch.compile of the cube's blocks is not built",
                                  f"{override('train.compile', False)}"))
    if cfg.train.precision != "fp32":
        issues.append(ConfigIssue("train.precision", "bf16 with 3-D tensor parallelism is not built (the cube "
                                  "computes in the weights' dtype)", f"{override('train.precision', 'fp32')}"))
    return issues
