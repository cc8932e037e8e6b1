"""Per-stage layouts (``parallel.pipeline.stages``): what the plan resolves for each stage, and
every bad form with its path, reason and fix (the cases of ``test_bad_configs.py``, for stages).

Run: ``python -m pytest tests/conf/test_stage_configs.py -q``
"""

from __future__ import annotations

import pytest
from test_bad_configs import Bad, assert_bad, bad, both, compose, put

from trainer.validate.checks import validate_with_plan

STAGES = ("parallel", "pipeline", "stages")


def stage_put(index: int, key: str, value) -> callable:
    def edit(raw: dict) -> None:
        raw["parallel"]["pipeline"]["stages"][index][key] = value

    return edit


CASES: dict[str, Bad] = {
    "ranks-overlap": bad(["+parallel=pp_stages"], "parallel.pipeline.stages[1].ranks", ["rank 1 is also in stage 0"],
                         ["exactly one stage"], edit=stage_put(1, "ranks", [1, 2])),
    "rank-does-not-exist": bad(["+parallel=pp_stages"], "parallel.pipeline.stages[1].ranks",
                               ["rank 7 does not exist", "0..3"], ["ranks below 4"],
                               edit=stage_put(1, "ranks", [2, 7])),
    "unequal-stage-sizes": bad(["+parallel=pp_stages", "mesh=[4]"], "parallel.pipeline.stages",
                               ["[1, 3] ranks", "lanes"],
                               ["give every stage 3 ranks"], edit=both(stage_put(0, "ranks", [0]),
                                                                       stage_put(1, "ranks", [1, 2, 3]))),
    "ranks-in-no-stage": bad(["+parallel=pp_stages", "mesh=[6]"], "parallel.pipeline.stages",
                             ["ranks [4, 5]", "no stage"],
                             ["mesh=[4]"]),
    "top-level-placements": bad(["+parallel=pp_stages"], "parallel.placements", ["each stage has its own layout"],
                                ["parallel.pipeline.stages[i].placements"],
                                edit=put("parallel", "placements", {"output.weight": {"pp": "Replicate"}})),
    "interleaved-schedule": bad(["+parallel=pp_stages", "parallel.pipeline.schedule=Interleaved1F1B",
                                 "parallel.pipeline.stages_per_rank=2"], "parallel.pipeline.schedule",
                                ["one stage per rank"], ["parallel.pipeline.schedule=1F1B "
                                                         "parallel.pipeline.stages_per_rank=1"]),
    "unknown-stage-axis": bad(["+parallel=pp_stages"], 'parallel.pipeline.stages[1].placements["output.weight"].tq',
                              ["not one of this stage's dims ['tp']"], ["parallel.pipeline.stages[1].dims"],
                              edit=stage_put(1, "placements", {"output.weight": {"tq": "Shard(0)"}})),
    "placement-on-stage-dp-axis": bad(["+parallel=pp_stages"],
                                      'parallel.pipeline.stages[0].placements["layers.0.*"].dp',
                                      ["data-parallel axis"], ["other axes"],
                                      edit=stage_put(0, "placements", {"layers.0.*": {"dp": "Shard(0)"}})),
    "glob-names-another-stages-parameter": bad(
        ["+parallel=pp_stages"], 'parallel.pipeline.stages[1].placements["tok_embeddings.weight"]',
        ["matches no parameter of this stage (parallel.pipeline.stages[1])"], ["fix the glob", "layers.2"],
        edit=stage_put(1, "placements", {"tok_embeddings.weight": {"tp": "Shard(0)"}})),
    "stage-ranks-decrease": bad(["+examples=stages_dp_x_tp"], "parallel.pipeline.stages[0].ranks",
                                ["decrease along the stage's axis 'dp'"], ["increasing"],
                                edit=stage_put(0, "ranks", [[2, 3], [0, 1]])),
    "stage-dims-do-not-match-ranks": bad(["+parallel=pp_stages"], "parallel.pipeline.stages[0].dims",
                                         ["names 2 axes", "have 1"], ["one axis name per axis"],
                                         edit=stage_put(0, "dims", ["dp", "x"])),
    "boundaries-do-not-make-the-stages": bad(["+examples=stages_dp_then_tp", "parallel.pipeline.boundaries=[]"],
                                             "parallel.pipeline.boundaries",
                                             ["0 boundaries make 1 stages", "parallel.pipeline.stages lists 2"],
                                             ["give 1 boundary"]),
    "batch-rows-do-not-split-over-lanes": bad(["+parallel=pp_stages", "train.global_batch_size=12"],
                                              "train.global_batch_size", ["dp size 2 x microbatches 4"],
                                              ["multiple of 8"]),
    "explicit-rank-ids-with-stages": bad(["+parallel=pp_stages", "mesh=[[0,1],[2,3]]", "parallel.dims=[pp,x]"], "mesh",
                                         ["stages already say"], ["mesh=[2,2]"]),
    "stage-tp-splits-heads": bad(["+parallel=pp_stages", "mesh=[8]"],
                                 'parallel.pipeline.stages[1].tensor_parallel.plan[megatron]["layers.*.attn.w[qkv].weight"].tp',
                                 ["split by heads", "model.n_kv_heads=2 over tp size 4"], ["use a tp size dividing 2"],
                                 edit=both(stage_put(0, "ranks", [0, 1, 2, 3]), stage_put(1, "ranks", [4, 5, 6, 7]))),
    "stage-tp-on-its-dp-axis": bad(["+parallel=pp_stages"], "parallel.pipeline.stages[0].tensor_parallel.dim",
                                   ["already the stage's data-parallel axis"], ["its own axis"],
                                   edit=stage_put(0, "tensor_parallel", {"dim": "dp"})),
    # A stage's own cp and ep axes (conf/parallel/pp_stages_cp.yaml, pp_stages_ep.yaml).
    "top-level-context-parallel": bad(["+parallel=pp_stages", "+parallel.context_parallel={dim: cp}"],
                                      "parallel.context_parallel", ["each stage has its own layout"],
                                      ["parallel.pipeline.stages[i].context_parallel"]),
    "stage-cp-seq-len": bad(["+parallel=pp_stages_cp", "train.seq_len=100"], "train.seq_len",
                            ["100 tokens do not cut into 2 x cp = 8", "stage 1's cp axis 'cp' of size 4"],
                            ["train.seq_len=96"]),
    "stage-cp-with-compile": bad(["+parallel=pp_stages_cp", "train.compile=true"], "train.compile",
                                 ["torch.compile with context parallelism (stage 1)"],
                                 ["train.compile=false", "parallel.pipeline.stages.1.context_parallel=null"]),
    "stage-cp-without-attention": bad(["+parallel=pp_stages_cp", "parallel.pipeline.boundaries=[norm]"],
                                      "parallel.pipeline.stages[1].context_parallel",
                                      ["holds no module of Transformer that attends over a split sequence"],
                                      ["parallel.pipeline.stages.1.context_parallel=null"]),
    "stage-cp-with-selective-recomputation": bad(
        ["+parallel=pp_stages_cp", "parallel.activation_checkpointing=selective"], "parallel.activation_checkpointing",
        ["selective with context parallelism"], ["parallel.activation_checkpointing=full"]),
    "stage-cp-on-its-dp-axis": bad(["+parallel=pp_stages_cp"], "parallel.pipeline.stages[0].context_parallel.dim",
                                   ["already the stage's data_parallel axis"], ["its own axis"],
                                   edit=stage_put(0, "context_parallel", {"dim": "dp"})),
    "stage-cp-unknown-axis": bad(["+parallel=pp_stages_cp"], "parallel.pipeline.stages[1].context_parallel.dim",
                                 ["axis 'sp' is not one of this stage's dims ['cp']"],
                                 ["parallel.pipeline.stages[1].dims"],
                                 edit=stage_put(1, "context_parallel", {"dim": "sp"})),
    "placement-on-stage-cp-axis": bad(["+parallel=pp_stages_cp"],
                                      'parallel.pipeline.stages[1].placements["output.weight"].cp',
                                      ["context- or expert-parallel axis"], ["other axes"],
                                      edit=stage_put(1, "placements", {"output.weight": {"cp": "Shard(0)"}})),
    "stage-ep-without-experts": bad(["+parallel=pp_stages_ep"], "parallel.pipeline.stages[1].expert_parallel",
                                    ["holds no experts of model Transformer"],
                                    ["parallel.pipeline.stages.1.expert_parallel=null"]),
    "stage-ep-experts-do-not-split": bad(["model=gpt_moe", "+parallel=pp_stages_ep", "model.moe.num_experts=6"],
                                         "model.moe.num_experts", ["6 experts do not split over the stage's "
                                                                   "expert-parallel axis 'ep' of size 4"],
                                         ["model.moe.num_experts=8"]),
    "stage-ep-beside-ddp": bad(["model=gpt_moe", "+parallel=pp_stages_ep"],
                               "parallel.pipeline.stages[1].data_parallel.mode", ["not ddp or zero1 yet"],
                               ["parallel.pipeline.stages.1.data_parallel.mode=fsdp"],
                               edit=both(stage_put(1, "ranks", [[4, 5], [6, 7]]), stage_put(1, "dims", ["dp", "ep"]),
                                         stage_put(1, "data_parallel", {"dim": "dp", "mode": "ddp"}))),
    "stage-moe-sequence-parallel": bad(["model=gpt_moe", "+parallel=pp_stages_ep"],
                                       "parallel.pipeline.stages[0].tensor_parallel.sequence_parallel",
                                       ["sequence parallelism of a mixture-of-experts model"],
                                       ["parallel.pipeline.stages.0.tensor_parallel.sequence_parallel=false"],
                                       edit=stage_put(0, "tensor_parallel", {"dim": "tp", "sequence_parallel": True})),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_bad_stage_config_names_path_reason_and_fix(case: Bad):
    assert_bad(case)


def test_each_stage_resolves_its_own_layout():
    """pp_stages on the built-in Llama: stage 0 (embeddings, layers 0-1) fsdp over ranks 0-1 with no
    placements; stage 1 (layers 2-3, norm, head) the Megatron plan on its tp axis, its parameters only."""
    _, plan = validate_with_plan(compose("+parallel=pp_stages"))
    pp = plan.pipeline
    assert plan.pp_size == 2 and pp.stage_units[0] == ("tok_embeddings", "layers.0", "layers.1")
    first, second = pp.stages
    assert (first.ranks, second.ranks) == ((0, 1), (2, 3))
    assert first.layout.mesh.shape == (2,) and first.layout.mesh.dim_names == ("dp",)
    assert first.layout.data_parallel.mode == "fsdp" and dict(first.layout.placements) == {}
    assert second.layout.data_parallel is None
    placed = {fqn: {a: str(p) for a, p in axes.items()} for fqn, axes in second.layout.placements.items()}
    assert placed["layers.2.attn.wq.weight"] == {"tp": "Shard(0)"}
    assert placed["layers.3.mlp.w2.weight"] == {"tp": "Shard(1)"}
    # loss parallel: the stage's head split over the vocabulary
    assert placed.pop("output.weight") == {"tp": "Shard(0)"}
    assert all(f.startswith(("layers.2.", "layers.3.")) for f in placed), sorted(placed)
    assert len(placed) == 2 * 7  # wq, wk, wv, wo, w1, w2, w3 of each of the stage's two blocks


def test_examples_are_the_seeds_stage_meshes():
    _, plan = validate_with_plan(compose("+examples=stages_dp_x_tp"))
    assert [s.rank_ids for s in plan.pipeline.stages] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert [str(s.layout.placements[w]["mp"]) for s, w in zip(plan.pipeline.stages,
                                                              ("w0", "w1"))] == ["Shard(1)", "Shard(0)"]
    _, plan = validate_with_plan(compose("+examples=stages_dp_then_tp"))
    assert [s.layout.data_parallel and s.layout.data_parallel.mode for s in plan.pipeline.stages] == ["ddp", None]


def test_a_stage_resolves_its_own_cp_and_ep_axes():
    """pp_stages_cp: stage 1's layout splits sequences over its cp axis (parameters sharded over it, as data
    parallel ranks); pp_stages_ep on gpt_moe: stage 1 splits its own blocks' experts over ep, and its rows."""
    _, plan = validate_with_plan(compose("+parallel=pp_stages_cp"))
    first, second = plan.pipeline.stages
    assert first.layout.context_parallel is None and second.layout.context_parallel.dim == "cp"
    assert second.layout.param_data_parallel.dim_names == ("cp",) and second.layout.cp_size == 4
    assert plan.cp_size == 1 and plan.dp_size == 4  # between stages: whole rows, a quarter per lane
    _, plan = validate_with_plan(compose("model=gpt_moe", "+parallel=pp_stages_ep"))
    first, second = plan.pipeline.stages
    assert first.layout.expert_parallel is None
    assert second.layout.expert_parallel.modules == ("layers.2.mlp.experts", "layers.3.mlp.experts")
    assert second.layout.topology.batch_axes == ("ep",) and second.layout.topology.ep_size == 4
