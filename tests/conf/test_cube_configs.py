"""``parallel.tensor_parallel_3d`` in configs (``+parallel=tp3d``, ``+parallel=tp3d_dp``): the presets validate, and
every refusal of a cube layout names its path, its reason and a fix that works as printed (the cases join the
catalogue that :mod:`test_printed_fixes` applies: :data:`CASES` is in ``fix_catalogue.MORE``).

Run: ``python -m pytest tests/conf/test_cube_configs.py -q``
"""

from __future__ import annotations

import pytest
from test_bad_configs import Bad, assert_bad, bad

from trainer.config.compose import compose_dict
from trainer.validate.checks import validate_with_plan

CASES: dict[str, Bad] = {
    "cube/not-a-cube": bad(["+parallel=tp3d", "mesh=[2,2,1]"], "mesh",
                           ["axes ['ca', 'cb', 'cc'] of sizes [2, 2, 1] are not a cube"], ["mesh=[2,2,2]"]),
    "cube/model-without-a-plan": bad(["+parallel=tp3d", "model=mlp", "data=regression"], "parallel.tensor_parallel_3d",
                                     ["provides no Megatron plan"], ["Llama-family model"]),
    "cube/experts": bad(["+parallel=tp3d", "model=gpt_moe"], "parallel.tensor_parallel_3d", ["has experts"],
                        ["+parallel=ep"]),
    "cube/ffn-does-not-split": bad(["+parallel=tp3d", "model.ffn_hidden_dim=170"], "parallel.tensor_parallel_3d",
                                   ["cannot split layers.0.mlp.w1: out features (170) do not divide by 4"],
                                   ["mesh=[1,1,1]"]),
    "cube/axis-not-in-dims": bad(["+parallel=tp3d", "parallel.tensor_parallel_3d.dims=[ca,cb,cx]"],
                                 "parallel.tensor_parallel_3d.dims", ["axis 'cx' is not in parallel.dims"]),
    "cube/axis-twice": bad(["+parallel=tp3d", "parallel.tensor_parallel_3d.dims=[ca,cb,cb]"],
                           "parallel.tensor_parallel_3d.dims", ["names an axis twice"]),
    "cube/beside-megatron": bad(["+parallel=tp3d", "+parallel.tensor_parallel={dim: ca}"], "parallel.tensor_parallel",
                                ["beside 3-D tensor parallelism is not built"], ["parallel.tensor_parallel=null"]),
    "cube/dp-on-a-cube-axis": bad(["+parallel=tp3d_dp", "parallel.data_parallel.dim=ca"],
                                  "parallel.data_parallel.dim", ["are the cube's"]),
    "cube/placements-beside": bad(["+parallel=tp3d", "+parallel.placements={layers.*.mlp.w2.weight: {ca: Shard(0)}}"],
                                  "parallel.placements", ["the cube places the blocks itself"],
                                  ["~parallel.placements"]),
    "cube/fsdp": bad(["+parallel=tp3d_dp", "parallel.data_parallel.mode=fsdp"],
                     "parallel.data_parallel.mode", ["at most two placements"], ["parallel.data_parallel.mode=ddp"]),
    "cube/rows-do-not-split": bad(["+parallel=tp3d", "train.global_batch_size=6"], "train.global_batch_size",
                                  ["6 rows, which do not split over the cube's 2 x 2 row blocks"],
                                  ["train.global_batch_size=4"]),
    "cube/packing": bad(["+parallel=tp3d", "data=files", "data.packing=true"], "data.packing", ["per-row positions"],
                        ["data.packing=false"]),
    "cube/lora": bad(["+parallel=tp3d", "model.lora.rank=4"], "model.lora", ["LoRA adapters on 3-D Linears"],
                     ["model.lora.rank=0"]),
    "cube/compile": bad(["+parallel=tp3d", "train.compile=true"], "train.compile", ["torch.compile of the cube"],
                        ["train.compile=false"]),
    "cube/bf16": bad(["+parallel=tp3d", "train.precision=bf16"], "train.precision", ["bf16 with 3-D tensor"],
                     ["train.precision=fp32"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cube_refusal(name: str):
    assert_bad(CASES[name])


@pytest.mark.parametrize("preset", ["tp3d", "tp3d_dp"])
def test_cube_presets_resolve_the_blocks_into_the_cube(preset: str):
    mesh = ["mesh=[2,2,2,2]"] if preset == "tp3d_dp" else []
    cfg, plan = validate_with_plan(compose_dict([f"+parallel={preset}", *mesh]))
    cube = plan.cube
    assert cube.dims == ("ca", "cb", "cc") and cube.split_heads  # gpt_debug: 4 heads over 2 kv heads, q = 2
    assert cube.first[:5] == ("layers.0.attn.wq", "layers.0.attn.wk", "layers.0.attn.wv", "layers.0.mlp.w1",
                              "layers.0.mlp.w3")
    assert set(cube.second) == {f"layers.{i}.{m}" for i in range(4) for m in ("attn.wo", "mlp.w2")}
    assert set(cube.norms) == {f"layers.{i}.{m}" for i in range(4) for m in ("attn_norm", "mlp_norm")}
    assert plan.topology.tp_size == 8 and plan.dp_size == (2 if preset == "tp3d_dp" else 1)


def test_nine_heads_are_gathered_not_refused(tmp_path):
    from tests.hf_assets import write_tied_llama

    write_tied_llama(tmp_path, vocab_size=258)
    _, plan = validate_with_plan(compose_dict(["model=hf", f"model.path={tmp_path}", "data=synthetic",
                                               "+parallel=tp3d", "train.global_batch_size=8"]))
    assert not plan.cube.split_heads and plan.cube.attention[0] == "model.layers.0.self_attn"


def test_the_cube_travels_with_the_plan_to_the_workers():
    """The launcher writes the resolved plan, the workers read it back (parallel.plan.serial): the cube with it."""
    import json

    from parallel.plan.serial import plan_from_dict, plan_to_dict

    _, plan = validate_with_plan(compose_dict(["+parallel=tp3d"]))
    back = plan_from_dict(json.loads(json.dumps(plan_to_dict(plan))))
    assert back.cube == plan.cube and back.cube is not None and back == plan
