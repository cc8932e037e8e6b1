"""Mixture-of-experts configs: the ``ep`` and ``fsdp_ep`` presets say what they should, the plan knows
the experts and the batch's axes, the dry run counts total and active parameters, and what is not built
yet is refused with the path, the reason and a fix (the fixes themselves run in ``test_printed_fixes``
through ``fix_catalogue``'s ``moe/`` cases).

Run: ``python -m pytest tests/conf/test_expert_configs.py -q``
"""

from __future__ import annotations

import pytest

from parallel.errors import ConfigError
from parallel.plan.resolve import resolve_plan
from trainer.config.compose import compose_dict
from trainer.models import build_model
from trainer.planner.numbers import plan_numbers
from trainer.planner.report import describe_plan, plan_report
from trainer.validate.checks import validate_config, validate_with_plan


def _validated(*overrides: str):
    return validate_with_plan(compose_dict(list(overrides)))


def _issues(*overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as refused:
        _validated(*overrides)
    return {i.path: str(i) for i in refused.value.issues}


def test_the_ep_preset_splits_the_experts_and_the_batch():
    cfg, plan = _validated("model=gpt_moe", "+parallel=ep")
    assert cfg.mesh_shape == (4,) and cfg.parallel.dims == ["ep"] and cfg.parallel.data_parallel is None
    assert cfg.parallel.expert_parallel.dim == "ep" and cfg.dp_size == plan.dp_size == 4
    assert plan.expert_parallel.modules == tuple(f"layers.{i}.mlp.experts" for i in range(4))
    assert plan.batch_dim_names == ("ep",) and plan.placements == {}


def test_the_fsdp_ep_preset_shards_over_dp_and_splits_experts_over_ep():
    cfg, plan = _validated("model=gpt_moe", "+parallel=fsdp_ep")
    assert cfg.mesh_shape == (2, 4) and cfg.parallel.dims == ["dp", "ep"]
    assert (cfg.parallel.data_parallel.dim, cfg.parallel.data_parallel.mode) == ("dp", "fsdp")
    assert plan.batch_dim_names == ("dp", "ep") and cfg.dp_size == plan.dp_size == 8


def test_the_dry_run_counts_total_and_active_parameters():
    cfg, plan = _validated("model=gpt_moe", "+parallel=fsdp_ep", "mesh=[2,2]", "dry_run=true")
    report = plan_report(cfg, plan)
    moe, dim, layers = cfg.model.moe, cfg.model.dim, cfg.model.n_layers
    experts = layers * moe.num_experts * 3 * dim * moe.hidden_dim
    params = report["parameters"]
    assert params["experts"] == experts
    assert params["total"] - params["active"] == experts - experts * moe.top_k // moe.num_experts
    # Each rank holds the non-expert parameters and its 8 / 2 experts (before FSDP shards them).
    assert report["per_pp_rank"][0]["params"] == params["total"] - experts + experts // 2
    # The experts' weights, gradients and AdamW moments per rank: 1/ep of them, then FSDP over dp (16 bytes each).
    e = report["experts"]
    assert e["expert_bytes_per_pp_rank"] == [experts / 2 / 2 * 16] and e["aux_loss_weight"] == moe.aux_loss_weight
    # Dispatch + combine, forward + backward: 4 all-to-alls per block of a rank's tokens' top_k rows (fp32),
    # half of them leaving the rank on ep 2.
    tokens = cfg.train.global_batch_size // 4 * cfg.train.seq_len
    assert e["all_to_all_bytes"] == report["comm"]["ep all-to-all"] == 4 * layers * tokens * moe.top_k * dim * 4 / 2
    text = describe_plan(cfg, plan, pictures_dir=None, report=report)
    assert f"parameters: {params['total']:,} in all, {params['active']:,} active per token" in text
    assert (f"split over ep (2 ranks, 4 experts each); router balance loss weight (model.moe.aux_loss_weight) "
            f"{moe.aux_loss_weight:g}") in text
    assert (f"experts per rank (weights + grads + AdamW): {experts / 4 * 16 / 2**20:.2f} MiB by pp rank; all-to-all "
            f"on ep: {e['all_to_all_bytes'] / 2**20:.2f} MiB sent per rank and step") in text


def test_a_dense_model_shows_one_parameter_count():
    cfg, plan = _validated("+parallel=fsdp", "dry_run=true")
    report = plan_report(cfg, plan)
    assert report["parameters"]["experts"] == 0 and report["parameters"]["active"] == report["parameters"]["total"]
    assert report["experts"] is None


def test_refusals_name_the_path_the_reason_and_the_fix():
    assert _issues("+parallel=ep")["parallel.expert_parallel"] == (
        "parallel.expert_parallel: model Transformer has no experts to split over axis 'ep' (a mixture-of-experts "
        "model names its stacked experts) (use a mixture-of-experts model, e.g. model=gpt_moe, or remove the ep axis "
        "(a preset without parallel.expert_parallel))")
    assert _issues("model=gpt_moe", "+parallel=ep", "model.moe.num_experts=6")["model.moe.num_experts"] == (
        "model.moe.num_experts: 6 experts do not split over the expert-parallel axis 'ep' of size 4 "
        "(use an ep size dividing 6, or model.moe.num_experts=8)")
    assert _issues("model=gpt_moe", "model.moe.top_k=9")["model.moe.top_k"] == (
        "model.moe.top_k: each token goes to 9 experts but there are only 8 (use top_k <= num_experts, "
        "e.g. model.moe.top_k=8)")
    _validated("model=gpt_moe", "+parallel=3d")  # built: the family plan splits the attention only, no mlp globs
    _validated("model=gpt_moe", "+parallel=pp_stages")  # built: each stage's own layout (tests/dist/test_stage_axes.py)
    _validated("model=gpt_moe", "+parallel=pp_stages_ep")


def test_placements_on_an_moe_model_are_refused_not_ignored():
    raw = compose_dict(["model=gpt_moe", "+parallel=tp"])
    raw["parallel"]["placements"] = {"layers.*.mlp.experts.w1": {"tp": "Shard(1)"}}
    with pytest.raises(ConfigError) as refused:
        validate_with_plan(raw)
    paths = {i.path for i in refused.value.issues}
    assert 'parallel.placements["layers.*.mlp.experts.w1"]' in paths, paths


def test_a_pipeline_with_experts_is_built_and_each_stage_prices_its_own_blocks():
    """pp x ep [2, 2] validates (1F1B, GPipe, interleaved: tests/dist/test_experts.py trains them), and a pp rank
    holds half the experts of its own blocks and sends the all-to-all of those blocks only (against ep [2])."""
    raw = compose_dict(["model=gpt_moe", "+parallel=pp", "mesh=[2,2]", "parallel.dims=[pp,ep]",
                        "+parallel.expert_parallel={dim: ep}"])
    cfg, plan = validate_with_plan(raw)
    assert plan.batch_dim_names == ("ep",) and cfg.dp_size == 2 and plan.pipeline.num_stages == 2
    alone_cfg = validate_config({**raw, "mesh": [2], "parallel": {**raw["parallel"], "dims": ["ep"], "pipeline": None}},
                                check_model=False)
    model = build_model(cfg.model, device="meta")
    staged = plan_numbers(cfg, plan, model=model)
    alone = plan_numbers(alone_cfg, resolve_plan(alone_cfg.parallel, alone_cfg.mesh, model), model=model)
    assert staged.comm["ep all-to-all"] == pytest.approx(alone.comm["ep all-to-all"] / 2)
    # the gradient all-reduce of the parameters beside the experts: a stage's own, about half (the embeddings aside)
    assert 0.3 * alone.comm["ep"] < staged.comm["ep"] < 0.7 * alone.comm["ep"]
    # The stages split the one rank's parameters (experts halved by ep): a tied embedding is counted twice.
    tied = cfg.model.vocab_size * cfg.model.dim
    assert sum(r.params for r in staged.per_pp_rank) - alone.per_pp_rank[0].params in (0, tied)
