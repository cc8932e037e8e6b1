"""Mixture-of-experts models and the expert-parallel axis: what is built, and the refusals (path,
reason, fix) of what is not yet, before any worker starts.

Built: a model with ``model.moe`` on one device, on data parallelism (its experts are plain
parameters there; fsdp is checked) and on tensor parallelism of its attention (tp, fsdp x tp), and
with ``parallel.expert_parallel`` alone, beside fsdp / zero2, beside tp, or beside both; each equals one
device (``tests/dist/test_experts.py``); on a pipeline too (every schedule), beside ep or not: each
stage adds its blocks' balance loss to the objective (:mod:`parallel.pipeline.stage_terms`); and on
per-stage layouts, a stage's own layout naming its ``expert_parallel`` axis or not (each stage's section is
checked as the top-level one is). Refused: what would need the balance loss or the dispatch to cross what
they do not cross yet (sequence shards, the experts' own placements), and the wrappers not tested with the dispatch
(activation checkpointing, torch.compile). That an ep axis needs a model
with experts is the plan's check (:mod:`parallel.plan.resolve`): it knows the model's modules.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from parallel.errors import ConfigIssue, format_path, override, override_key
from trainer.config.schema import LlamaConfig, RunConfig
from trainer.models import moe_config


# A block's MoE parameters and modules, as globs meet them (the attention's placements stay the user's).
# The built-in names and a Hugging Face model's (model.layers.0.mlp...).
_MLPS = ("layers.0.mlp", "model.layers.0.mlp")
_MOE_NAMES = {
    "placements": [name for mlp in _MLPS for name in (f"{mlp}.router.gate.weight",
                                                      *(f"{mlp}.experts.w{i}" for i in (1, 2, 3)),
                                                       *(f"{mlp}.shared.w{i}.weight" for i in (1, 2, 3)))],
    "layouts": [name for mlp in _MLPS for name in (mlp, f"{mlp}.router", f"{mlp}.router.gate", f"{mlp}.experts",
                                                    f"{mlp}.shared", *(f"{mlp}.shared.w{i}" for i in (1, 2, 3)))],
}


def check_experts(cfg: RunConfig) -> list[ConfigIssue]:
    """The model's mixture of experts (``model.moe``, or a Hugging Face directory's config.json) against
    itself and the layout, and the ep axis against the layout."""
    moe = moe_config(cfg.model)
    # A Hugging Face model's experts are its config.json's: reported at model.path, changed there.
    built_in = isinstance(cfg.model, LlamaConfig)
    par = cfg.parallel
    issues = []
    if moe is not None and moe.top_k > moe.num_experts:
        issues.append(ConfigIssue("model.moe.top_k" if built_in else "model.path",
                                  f"{'' if built_in else '(config.json) '}each token goes to {moe.top_k} experts but "
                                  f"there are only {moe.num_experts}", "use top_k <= num_experts, e.g. "
                                                                       "model.moe.top_k="
                                  f"{moe.num_experts}" if built_in else "give a config.json with "
                                                                        "num_experts_per_tok <= its experts"))
    ep = par.expert_parallel if par is not None else None
    if (ep is not None and par is not None and moe is not None and ep.dim in par.dims
            and len(par.dims) == len(cfg.mesh_shape)):
        size = cfg.axis_size(ep.dim)
        if moe.num_experts % size:
            fit = size * -(-moe.num_experts // size)
            issues.append(ConfigIssue("model.moe.num_experts" if built_in else "model.path",
                                      f"{moe.num_experts} experts do not split over the "
                                      f"expert-parallel axis {ep.dim!r} of size {size}",
                                      f"use an {ep.dim} size dividing {moe.num_experts}"
                                      + (f", or model.moe.num_experts={fit}" if built_in else "")))
    if moe is not None and cfg.train.compile:
        issues.append(ConfigIssue("train.compile", "torch.compile of a mixture-of-experts model is not tested yet "
                                  "(its routing has data-dependent shapes)", "train.compile=false"))
    if par is None or (moe is None and ep is None):
        return issues
    if par.pipeline is not None and par.pipeline.stages:  # each stage's own layout; a top-level one is refused
        for index, stage in enumerate(par.pipeline.stages):
            prefix = ("parallel", "pipeline", "stages", index)
            issues += _check_layout(stage, prefix, moe is not None) + _stage_expert_split(stage, prefix, moe, built_in)
    else:
        issues += _check_layout(par, ("parallel",), moe is not None)
    if moe is not None and par.activation_checkpointing != "none":
        issues.append(ConfigIssue("parallel.activation_checkpointing", "activation checkpointing of a "
                                  "mixture-of-experts model is not tested yet",
                                  "parallel.activation_checkpointing=none"))
    return issues


def _check_layout(section, prefix: tuple, has_moe: bool) -> list[ConfigIssue]:
    """One layout section (``parallel``, or a stage's ``parallel.pipeline.stages[i]``) against a model with
    experts (``has_moe``) or an ep axis: what of it the dispatch and the balance loss do not cross yet."""
    issues = []
    ep, dp = section.expert_parallel, section.data_parallel
    if ep is not None and dp is not None and dp.mode in ("ddp", "zero1"):
        issues.append(ConfigIssue(format_path(*prefix, "data_parallel", "mode"), "expert parallelism composes with "
                                  "data_parallel mode fsdp, zero2 or hsdp, not ddp or zero1 yet (their replicas would "
                                  "each hold every expert's gradient whole)",
                                  override(override_key(*prefix, "data_parallel", "mode"), "fsdp")))
    if not has_moe:
        return issues
    if section.tensor_parallel is not None and section.tensor_parallel.sequence_parallel:
        path = format_path(*prefix, "tensor_parallel", "sequence_parallel")
        issues.append(ConfigIssue(path, "sequence parallelism of a mixture-of-experts model is not built yet (the "
                                  "router would see the sequence's shards as a DTensor)",
                                  override(override_key(*prefix, "tensor_parallel", "sequence_parallel"), False)))
    for key in ("placements", "layouts"):
        for glob in getattr(section, key):
            if any(fnmatchcase(name, glob) for name in _MOE_NAMES[key]):
                issues.append(ConfigIssue(format_path(*prefix, key, glob), "placements and layouts of a "
                                          "mixture-of-experts block (router, experts, shared experts) are "
                                          "not built yet (its experts are placed by expert_parallel)",
                                          "remove this glob, and use data or expert parallelism"))
    return issues


def _stage_expert_split(stage, prefix: tuple, moe, built_in: bool) -> list[ConfigIssue]:
    """A stage's ep axis divides the experts (its size is the stage's ranks along it)."""
    ep = stage.expert_parallel
    if ep is None or moe is None or ep.dim not in stage.dims or len(stage.dims) != len(stage.shape):
        return []  # an unknown axis is the stage checks' issue
    size = stage.shape[stage.dims.index(ep.dim)]
    if moe.num_experts % size == 0:
        return []
    fit = size * -(-moe.num_experts // size)
    return [ConfigIssue(format_path(*prefix, "expert_parallel", "dim") if not built_in else "model.moe.num_experts",
                        f"{moe.num_experts} experts do not split over the stage's expert-parallel axis {ep.dim!r} of "
                        f"size {size} ({format_path(*prefix, 'ranks')})",
                        f"model.moe.num_experts={fit}" if built_in else
                        f"give {format_path(*prefix)} a number of ranks along {ep.dim!r} dividing {moe.num_experts}")]

