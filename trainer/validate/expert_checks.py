"""Mixture-of-experts models and the expert-parallel axis: what is built, and the refusals (path,
reason, fix) of what is not yet, before any worker starts.

Built: a model with ``model.moe`` on one device, on data parallelism (its experts are plain
parameters there; fsdp is checked) and on tensor parallelism of its attention (tp, fsdp x tp), and
with ``parallel.expert_parallel`` alone, beside fsdp / zero2, beside tp, or beside both; each equals one
device (``tests/dist/test_experts.py``); on a pipeline too (every schedule), beside ep or not: each
stage adds its blocks' balance loss to the objective (:mod:`parallel.pipeline.stage_terms`). Refused:
what would need the balance loss or the dispatch to cross what they do not cross yet (sequence shards,
the experts' own placements, per-stage layouts), and the wrappers not tested with the dispatch
(activation checkpointing, torch.compile). That an ep axis needs a model
with experts is the plan's check (:mod:`parallel.plan.resolve`): it knows the model's modules.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from parallel.errors import ConfigIssue, override
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
    what = "expert parallelism" if moe is None else "a mixture-of-experts model"
    pp = par.pipeline
    if pp is not None and pp.stages:
        issues.append(ConfigIssue("parallel.pipeline.stages", f"{what} on per-stage layouts is not built yet (one "
                                  "layout for every stage is: parallel.expert_parallel, data and tensor parallelism "
                                  "beside the pipeline)", f"{override('parallel.pipeline.stages', None)}"))
    if ep is not None and par.data_parallel is not None and par.data_parallel.mode in ("ddp", "zero1"):
        issues.append(ConfigIssue("parallel.data_parallel.mode", "expert parallelism composes with data_parallel "
                                  "mode fsdp, zero2 or hsdp, not ddp or zero1 yet (their replicas would each hold "
                                  "every expert's gradient whole)", "parallel.data_parallel.mode=fsdp"))
    if moe is None:
        return issues
    if par.tensor_parallel is not None and par.tensor_parallel.sequence_parallel:
        issues.append(ConfigIssue("parallel.tensor_parallel.sequence_parallel", "sequence parallelism of a "
                                  "mixture-of-experts model is not built yet (the router would see the sequence's "
                                  "shards as a DTensor)", "parallel.tensor_parallel.sequence_parallel=false"))
    for section, globs in (("placements", par.placements), ("layouts", par.layouts)):
        for glob in globs:
            if any(fnmatchcase(name, glob) for name in _MOE_NAMES[section]):
                issues.append(ConfigIssue(f'parallel.{section}["{glob}"]', "placements and layouts of a "
                                          "mixture-of-experts block (router, experts, shared experts) are "
                                          "not built yet (its experts are placed by parallel.expert_parallel)",
                                          "remove this glob, and use data or expert parallelism"))
    if par.activation_checkpointing != "none":
        issues.append(ConfigIssue("parallel.activation_checkpointing", "activation checkpointing of a "
                                  "mixture-of-experts model is not tested yet",
                                  "parallel.activation_checkpointing=none"))
    return issues
