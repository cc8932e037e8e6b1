"""``parallel.context_parallel`` in configs: the presets ``cp``, ``fsdp_cp`` and ``3d_cp`` hold what they say,
and every refusal of a cp layout names its path, its reason and a fix that works as printed (the cases
join the catalogue that :mod:`test_printed_fixes` applies: :data:`CASES` is in ``fix_catalogue.MORE``).

Run: ``python -m pytest tests/conf/test_context_configs.py -q``
"""

from __future__ import annotations

import pytest
from test_bad_configs import Bad, assert_bad, bad

from parallel.plan.resolve import resolve_plan
from trainer.config.compose import compose_dict
from trainer.models import build_model
from trainer.planner.memory.predict import predict_memory
from trainer.planner.numbers import plan_numbers
from trainer.validate.checks import validate_config, validate_with_plan

_EMBEDDING = ["model=custom", "model.builder=torch.nn:Embedding", "model.kwargs={num_embeddings: 256, "
                                                                  "embedding_dim: 256}"]

CASES: dict[str, Bad] = {
    "cp/seq-len-not-in-2cp-chunks": bad(
        ["+parallel=cp", "mesh=[4]", "train.seq_len=100"], "train.seq_len",
        ["100 tokens do not cut into 2 x cp = 8 equal chunks", "a head and a tail chunk"],
        ["multiple of 8", "train.seq_len=96"]),
    "cp/sequence-parallel-on-a-cp-share": bad(
        ["+parallel=3d_cp", "mesh=[1,2,4]", "parallel.tensor_parallel.sequence_parallel=true", "train.seq_len=36",
         "model.n_kv_heads=4"],
        "train.seq_len", ["36 tokens (18 per cp rank) do not split evenly over the sequence-parallel axis "
                          "'tp' of size 4"],
        ["multiple of 8", "train.seq_len=32"]),
    "cp/with-compile": bad(
        ["+parallel=cp", "mesh=[2]", "train.compile=true"], "train.compile",
        ["torch.compile with context parallelism is not built yet"],
        ["train.compile=false", "parallel.context_parallel=null"]),
    "cp/custom-module": bad(
        ["+parallel=cp", "mesh=[2]", *_EMBEDDING], "parallel.context_parallel",
        ["model.arch custom: no module of Embedding attends over a split sequence", "context_parallel attribute"],
        ["parallel.context_parallel=null 'parallel.data_parallel={dim: cp, mode: fsdp}'"]),
    "cp/mlp-beside-dp": bad(
        ["+parallel=fsdp_cp", "model=mlp", "data=regression"], "parallel.context_parallel",
        ["model.arch mlp: no module of MatmulMLP"], ["parallel.context_parallel=null 'mesh=[2,1]'"]),
    "cp/axis-not-in-dims": bad(
        ["+parallel=cp", "parallel.context_parallel.dim=sp"], "parallel.context_parallel.dim",
        ["axis 'sp' is not in parallel.dims ['cp']"]),
    "cp/axis-is-the-dp-axis": bad(
        ["+parallel=fsdp_cp", "parallel.context_parallel.dim=dp"], "parallel.context_parallel.dim",
        ["axis 'dp' is already the data-parallel axis"], ["give context parallelism its own mesh axis"]),
    "cp/parameters-placed-on-cp": bad(
        ["+parallel=cp", "mesh=[2]", "+parallel.placements={layers.*.mlp.w2.weight: {cp: Shard(0)}}"],
        'parallel.placements["layers.*.mlp.w2.weight"].cp', ["the context_parallel axis"]),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_a_cp_refusal_names_path_reason_and_fix(case: Bad):
    assert_bad(case)


def _validated(*overrides: str):
    cfg = validate_config(compose_dict(list(overrides)))
    return cfg, resolve_plan(cfg.parallel, cfg.mesh, build_model(cfg.model, device="meta"))


def test_cp_preset_splits_sequences_over_four_ranks_that_shard_parameters():
    cfg, plan = _validated("+parallel=cp")
    assert cfg.mesh_shape == (4,) and cfg.parallel.dims == ["cp"] and cfg.dp_size == 1
    assert (cfg.parallel.context_parallel.dim, cfg.parallel.context_parallel.method) == ("cp", "ring")
    assert plan.cp_size == 4 and plan.data_parallel is None and plan.param_data_parallel.dim_names == ("cp",)


def test_fsdp_cp_preset_folds_cp_into_the_fsdp_mesh():
    cfg, plan = _validated("+parallel=fsdp_cp", "mesh=[2,4]")
    assert cfg.parallel.dims == ["dp", "cp"] and (cfg.dp_size, plan.cp_size) == (2, 4)
    assert plan.data_parallel.mode == "fsdp" and plan.param_data_parallel.dim_names == ("dp", "cp")


def test_hsdp_folds_cp_into_its_shard_axis():
    """hsdp x cp [2, 2, 2]: replicated over dp_replicate, sharded over dp_shard x cp (4 ranks), so a rank
    holds a quarter of the parameters; the rows split over the two dp axes only."""
    cfg, plan = _validated("+parallel=hsdp", "mesh=[2,2,2]", "parallel.dims=[dp_replicate,dp_shard,cp]",
                           "+parallel.context_parallel={dim: cp}")
    dp = plan.param_data_parallel
    assert (dp.mode, dp.dim_names, dp.shard_dim_names) == ("hsdp", ("dp_replicate", "dp_shard", "cp"),
                                                           ("dp_shard", "cp"))
    assert (cfg.dp_size, plan.cp_size) == (4, 2)
    model = build_model(cfg.model, device="meta")
    held = plan_numbers(cfg, plan, model=model).per_pp_rank[0].param_bytes / 4  # fp32
    assert held == pytest.approx(sum(p.numel() for p in model.parameters()) / 4, rel=0.01)


@pytest.mark.parametrize("layout", [["+parallel=cp", "mesh=[2]"], ["+parallel=fsdp_cp", "mesh=[2,2]"],
                                    ["+parallel=ep", "mesh=[2,2]", "parallel.dims=[ep,cp]",
                                     "+parallel.context_parallel={dim: cp}"]],
                         ids=["cp", "fsdp_cp", "ep_cp"])
def test_a_mixture_of_experts_with_cp_is_built_and_planned(layout):
    """gpt_moe on cp layouts validates with the model-side checks (tests/dist/test_context.py trains them) and the
    memory model counts a cp rank's share of each row: cp [2]'s activations are fsdp [2]'s on the same batch (a rank
    holds half of its tokens either way; the CPU ring keeps no scores)."""
    row = ["model=gpt_moe", "train.seq_len=256", "tracking=none"]
    cfg, plan = validate_with_plan(compose_dict([*row, *layout]))
    assert plan.cp_size == 2 and "cp" in plan.param_data_parallel.dim_names
    assert (plan.expert_parallel is not None) == ("ep" in cfg.parallel.dims)
    if layout[0] == "+parallel=cp":
        (cp,) = predict_memory(cfg, plan)
        (fsdp,) = predict_memory(*validate_with_plan(compose_dict([*row, "+parallel=fsdp", "mesh=[2]"])))
        assert cp.activations == pytest.approx(fsdp.activations, rel=0.05), (cp.activations, fsdp.activations)


def test_3d_cp_preset_is_dp_cp_tp():
    cfg, plan = _validated("+parallel=3d_cp")
    assert cfg.mesh_shape == (2, 2, 2) and cfg.parallel.dims == ["dp", "cp", "tp"]
    assert (cfg.dp_size, plan.cp_size, cfg.axis_size("tp")) == (2, 2, 2)
    assert {axis: str(p) for axis, p in plan.placements["layers.0.attn.wq.weight"].items()} == {"tp": "Shard(0)"}


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_both_methods_validate_on_hugging_face_names(method, tmp_path):
    from tests.hf_assets import write_tiny_llama

    write_tiny_llama(tmp_path)
    cfg, plan = _validated("+parallel=cp", "mesh=[2]", "model=hf", f"model.path={tmp_path}",
                           f"parallel.context_parallel.method={method}", "train.seq_len=64")
    assert plan.context_parallel.method == method


def test_a_pipeline_with_cp_is_built_and_each_stage_sends_its_own_layers_k_v():
    """pp x cp [2, 2] validates (tests/dist/test_context.py trains it): a pp rank rings K/V for its stage's layers
    only, half of what cp [2] alone sends."""
    raw = compose_dict(["+parallel=pp", "mesh=[2,2]", "parallel.dims=[pp,cp]", "+parallel.context_parallel={dim: cp}",
                        "parallel.pipeline.microbatches=2"])
    cfg, plan = validate_with_plan(raw)
    assert plan.cp_size == 2 and plan.pipeline.num_stages == 2
    alone = validate_config({**raw, "mesh": [2], "parallel": {**raw["parallel"], "dims": ["cp"], "pipeline": None}},
                            check_model=False)
    model = build_model(cfg.model, device="meta")
    alone_plan = resolve_plan(alone.parallel, alone.mesh, model)
    staged, alone_kv = plan_numbers(cfg, plan, model=model).comm, plan_numbers(alone, alone_plan, model=model).comm
    assert staged["cp K/V"] == pytest.approx(alone_kv["cp K/V"] / 2)


def test_a_cuda_run_is_priced_with_the_ring_it_runs():
    """Every device runs the fused ring (parallel/context/ring.py: CPU's flash kernel, CUDA's in bf16):
    a GPU profile's prediction keeps what a CPU run's does, q, k, v, the output and a log-sum-exp per
    query, no block's scores (before the CUDA ring, a GPU profile counted each block's fp32 scores:
    4 rows x 4 heads x 256 x 256 x 4 bytes, 4 blocks, 4 layers, 16 MiB at least beside these)."""
    row = ["+parallel=cp", "mesh=[4]", "train.seq_len=2048", "model.max_seq_len=2048", "train.global_batch_size=4"]
    (cpu,) = predict_memory(*validate_with_plan(compose_dict([*row, "tracking=none"])))
    (gpu,) = predict_memory(*validate_with_plan(compose_dict([*row, "hardware=h100_sxm", "dry_run=true",
                                                              "tracking=none"])))
    assert gpu.activations == pytest.approx(cpu.activations)
