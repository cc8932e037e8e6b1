"""Validation of ``parallel.context_parallel`` (each sequence split over a mesh axis, :mod:`parallel.context`):
what the split needs of the config, and what it needs of the model.

* ``train.seq_len`` cuts into ``2 x cp`` equal chunks (each cp rank holds a head and a tail chunk);
* the model has an attention that attends over a split sequence (the built-in and Hugging Face
  Llama-family decoders); a custom module or the MLP is refused with the reason;
* what is not built yet is refused with a fix that drops one of the two: torch.compile.
  Per-stage layouts take cp in a stage's own layout (``parallel.pipeline.stages[i].context_parallel``, checked
  per stage here; the stage must hold an attention, :mod:`parallel.plan.stages`). A pipeline with cp is built
  (every stage holds its cp rank's chunks of each micro-batch's rows), and so is
  hsdp (the cp axis folded into its shard axis), and a mixture of experts, expert parallel or not (its balance
  loss sums each row's statistics over the cp ranks, :mod:`trainer.models.moe`).
"""

from __future__ import annotations

from torch import nn

from parallel.context import supports_context_parallel
from parallel.errors import ConfigIssue, override
from trainer.config.schema import RunConfig

PATH = "parallel.context_parallel"


def check_context(cfg: RunConfig) -> list[ConfigIssue]:
    """The config's side: sequence length, and the layouts cp is not built with (no model needed)."""
    par = cfg.parallel
    if par is not None and par.pipeline is not None and par.pipeline.stages:
        return check_stage_context(cfg)
    cp = par.context_parallel if par is not None else None
    # An unknown axis, or dims that do not match the mesh, are reported with the other axes' issues.
    if par is None or cp is None or cp.dim not in par.dims or cfg.mesh is None or len(par.dims) != len(cfg.mesh_shape):
        return []
    issues = []
    size = cfg.axis_size(cp.dim)
    chunks = 2 * size
    if size > 1 and cfg.train.seq_len % chunks:
        fit = chunks * max(1, cfg.train.seq_len // chunks)
        issues.append(ConfigIssue("train.seq_len", f"{cfg.train.seq_len} tokens do not cut into 2 x cp = "
                                                   f"{chunks} equal "
                                  f"chunks: each of the {size} cp ranks holds a head and a tail chunk of every row, so "
                                  "that causal attention costs every rank the same",
                                  f"use a multiple of {chunks}, e.g. {override('train.seq_len', fit)}"))
    drop_cp = without_cp(cfg)
    if cfg.train.compile:
        issues.append(ConfigIssue("train.compile", "torch.compile with context parallelism is not built "
                                                   "yet: the ring's hops and its skipped blocks would break every "
                                                   "block's graph",
                                  f"set {override('train.compile', False)}, or train without context parallelism "
                                  f"({drop_cp})"))
    return issues


def check_stage_context(cfg: RunConfig) -> list[ConfigIssue]:
    """Per-stage layouts: each stage's own ``context_parallel`` (a top-level one is the stage checks' issue)
    cuts ``train.seq_len`` into 2 x its cp size chunks, and is not compiled. The stages' activations cross
    their boundaries as whole rows, so each stage's cp size is its own."""
    par = cfg.parallel
    assert par is not None and par.pipeline is not None and par.pipeline.stages, "called for staged layouts"
    issues = []
    for index, stage in enumerate(par.pipeline.stages):
        cp = stage.context_parallel
        if cp is None or cp.dim not in stage.dims or len(stage.dims) != len(stage.shape):
            continue  # an unknown axis is the stage checks' issue
        size = stage.shape[stage.dims.index(cp.dim)]
        chunks = 2 * size
        drop = override(f"parallel.pipeline.stages.{index}.context_parallel", None)
        if size > 1 and cfg.train.seq_len % chunks:
            fit = chunks * max(1, cfg.train.seq_len // chunks)
            issues.append(ConfigIssue("train.seq_len", f"{cfg.train.seq_len} tokens do not cut into 2 x cp = {chunks} "
                                      f"equal chunks for stage {index}'s cp axis {cp.dim!r} of size {size}: each cp "
                                      "rank holds a head and a tail chunk of every row",
                                      f"use a multiple of {chunks}, e.g. {override('train.seq_len', fit)}"))
        if cfg.train.compile:
            issues.append(ConfigIssue("train.compile", f"torch.compile with context parallelism (stage {index}) is not "
                                      "built yet: the ring's hops and its skipped blocks would break every block's "
                                      "graph", f"set {override('train.compile', False)}, or train the stage without "
                                      f"context parallelism ({drop})"))
    return issues


def without_cp(cfg: RunConfig) -> str:
    """The overrides that train ``cfg`` without context parallelism, as typed: the cp ranks become
    data-parallel ranks (fsdp over the cp axis) when there is no dp axis, else the cp axis shrinks
    to size 1 (an axis of several ranks that no role names is refused)."""
    par = cfg.parallel
    assert par is not None and par.context_parallel is not None, "called for a cp layout"
    cp = par.context_parallel
    if par.data_parallel is None:
        return f"{override(PATH, None)} {override('parallel.data_parallel', {'dim': cp.dim, 'mode': 'fsdp'})}"
    return f"{override(PATH, None)} {_mesh_without(cfg, cp.dim)}"


def _mesh_without(cfg: RunConfig, axis: str) -> str:
    """``mesh=[...]`` with ``axis`` shrunk to size 1, the other axes as they are."""
    assert cfg.parallel is not None, "called for a parallel layout"
    shape = [1 if name == axis else size for name, size in zip(cfg.parallel.dims, cfg.mesh_shape)]
    return override("mesh", shape)


def check_context_model(cfg: RunConfig, model: nn.Module) -> list[ConfigIssue]:
    """The model's side: some module of ``model`` (built on meta) attends over a split sequence."""
    par = cfg.parallel
    cp = par.context_parallel if par is not None else None
    if cp is None or supports_context_parallel(model):
        return []
    # The cp ranks can still train: as data-parallel ranks (or, beside a dp axis, not at all).
    fix = without_cp(cfg)
    return [ConfigIssue(PATH, f"model.arch {cfg.model.arch}: no module of {type(model).__name__} attends over a split "
                        "sequence. Context parallelism needs an attention that takes its rank's chunks of "
                        "every row and sees the whole row (the built-in and Hugging Face Llama-family decoders have "
                        "one); a module opts in by declaring a context_parallel attribute and calling "
                        "parallel.context.context_attention", f"use the cp ranks for data instead: {fix}")]
