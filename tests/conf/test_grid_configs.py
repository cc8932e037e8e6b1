"""``parallel.grid_parallel`` in configs: the presets ``tp2d``, ``tp2d_dp`` and ``tp2p5d`` hold what they say, and
every refusal of a grid layout names its path, its reason and a fix that works as printed (the cases join the
catalogue that :mod:`test_printed_fixes` applies: :data:`CASES` is in ``fix_catalogue.MORE``).

Run: ``python -m pytest tests/conf/test_grid_configs.py -q``
"""

from __future__ import annotations

import json
import shlex
import tempfile
from pathlib import Path

import pytest
from test_bad_configs import Bad, assert_bad, bad

from parallel.errors import ConfigError
from trainer.config.compose import compose_dict
from trainer.validate.checks import validate_config, validate_with_plan


def _smollm2_config() -> str:
    """SmolLM2's shape as a config.json (validation reads no weights): 9 heads over 3 kv heads, dim 72, ffn 192."""
    path = Path(tempfile.mkdtemp(prefix="meshflow-smol-"))
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 72, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 256, "max_position_embeddings": 256,
        "rope_theta": 100000.0, "tie_word_embeddings": True}))
    return str(path)


SMOL = ["model=hf", f"model.path={_smollm2_config()}"]

CASES: dict[str, Bad] = {
    "grid/not-square": bad(["+parallel=tp2d", "mesh=[2,4]"], "mesh",
                           ["the grid row x col is 2 x 4", "needs a square grid"], ["mesh=[2,2]"]),
    "grid/2p5d-not-square": bad(["+parallel=tp2p5d", "mesh=[2,1,2]"], "mesh", ["is 1 x 2"], ["mesh=[2,1,1]"]),
    "grid/nine-heads-on-2x2": bad([*SMOL, "+parallel=tp2d"], "parallel.grid_parallel",
                                  ["the 2 x 2 grid cannot split", "heads 9", "kv heads 3"],
                                  ["'mesh=[3,3]' train.global_batch_size=15"]),
    "grid/nine-heads-on-depth": bad([*SMOL, "+parallel=tp2p5d"], "parallel.grid_parallel",
                                    ["heads 9"], ["'mesh=[1,3,3]' train.global_batch_size=15 (9 ranks",
                                                  "'mesh=[2,3,3]' train.global_batch_size=18 (18 ranks)"]),
    "grid/with-a-pipeline": bad(["+parallel=tp2d", "+parallel.pipeline={dim: row}"], "parallel.pipeline",
                                ["a pipeline beside a 2-D / 2.5-D grid is not built"], ["parallel.pipeline=null"]),
    "grid/with-1d-tp": bad(["+parallel=tp2d_dp", "+parallel.tensor_parallel={dim: dp}"], "parallel.tensor_parallel",
                           ["1-D tensor parallelism beside"], ["parallel.tensor_parallel=null"]),
    "grid/with-placements": bad(["+parallel=tp2d", "mesh=[2,2]", "+parallel.placements={norm.weight: {row: Shard(0)}}"],
                                "parallel.placements", ["places every block's Linears"],
                                ["remove parallel.placements"]),
    "grid/hsdp": bad(["+parallel=tp2d_dp", "mesh=[2,2,2]", "parallel.data_parallel={dim: [dp, row], mode: hsdp}"],
                     "parallel.data_parallel.mode", ["hsdp beside a grid"],
                     ["parallel.data_parallel={dim: dp, mode: fsdp}"]),
    "grid/activation-checkpointing": bad(["+parallel=tp2d", "parallel.activation_checkpointing=full"],
                                         "parallel.activation_checkpointing", ["not built yet"],
                                         ["parallel.activation_checkpointing=none"]),
    "grid/compile": bad(["+parallel=tp2d", "train.compile=true"], "train.compile", ["torch.compile of grid blocks"],
                        ["train.compile=false"]),
    "grid/batch-over-rows": bad(["+parallel=tp2d", "mesh=[4,4]", "train.global_batch_size=6"],
                                "train.global_batch_size", ["6 sequences do not split over the grid's 4 rows"],
                                ["train.global_batch_size=8"]),
    "grid/axis-not-in-dims": bad(["+parallel=tp2d", "parallel.grid_parallel.cols=tp"], "parallel.grid_parallel.cols",
                                 ["axis 'tp' is not in parallel.dims"], []),
    "grid/axis-taken": bad(["+parallel=tp2d_dp", "parallel.grid_parallel.rows=dp"], "parallel.grid_parallel.rows",
                           ["already the data_parallel axis"], []),
    "grid/experts": bad(["+parallel=tp2d", "model=gpt_moe"], "parallel.grid_parallel",
                        ["a mixture of experts on a grid"], ["model=gpt_debug"]),
    "grid/lora": bad(["+parallel=tp2d", "model.lora.rank=4"], "parallel.grid_parallel",
                     ["LoRA adapters on a grid"], ["model.lora.rank=0"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_grid_refusal_names_its_path_reason_and_fix(name):
    assert_bad(CASES[name])


def test_the_printed_fix_for_nine_heads_validates_as_printed():
    """SmolLM2 on 2 x 2: refused with ``mesh=[3,3]``, which splits 9 heads and 3 kv heads over 3 columns, and a
    batch that splits over its 3 rows."""
    raw = compose_dict([*SMOL, "+parallel=tp2d"])
    with pytest.raises(ConfigError) as excinfo:
        validate_config(raw)
    (issue,) = [i for i in excinfo.value.issues if i.path == "parallel.grid_parallel"]
    fix = shlex.split(issue.fix.rsplit(": ", 1)[1])  # as a shell reads what was printed
    assert fix == ["mesh=[3,3]", "train.global_batch_size=15"], issue.fix
    cfg, plan = validate_with_plan(compose_dict([*SMOL, "+parallel=tp2d", *fix]))
    assert cfg.world_size == 9 and plan is not None and plan.grid is not None


def test_the_smallest_printed_fix_for_nine_heads_on_depth_validates_as_printed():
    """SmolLM2 on tp2p5d's 2 x 2 x 2: refused first with one layer of depth on a 3 x 3 grid (9 ranks, not 18), the
    fix tests/dist/test_grid.py trains; the batch splits over its 3 rows."""
    with pytest.raises(ConfigError) as excinfo:
        validate_config(compose_dict([*SMOL, "+parallel=tp2p5d"]))
    (issue,) = [i for i in excinfo.value.issues if i.path == "parallel.grid_parallel"]
    first = issue.fix.split(": ", 1)[1].split(" (", 1)[0]
    fix = shlex.split(first)  # as a shell reads what was printed
    assert fix == ["mesh=[1,3,3]", "train.global_batch_size=15"], issue.fix  # grid_checks.SMOL_2P5D_FIX
    cfg, plan = validate_with_plan(compose_dict([*SMOL, "+parallel=tp2p5d", *fix]))
    assert cfg.world_size == 9 and plan is not None and plan.grid is not None
    assert (plan.grid.depth, plan.mesh.shape, plan.topology.dp_size) == ("depth", (1, 3, 3), 1)


@pytest.mark.parametrize("preset, mesh, dp_axes, grid", [
    ("tp2d", (2, 2), (), ("row", "col", None)),
    ("tp2d_dp", (2, 2, 2), ("dp",), ("row", "col", None)),
    ("tp2p5d", (2, 2, 2), (), ("row", "col", "depth")),
])
def test_grid_presets_resolve_to_their_grid(preset, mesh, dp_axes, grid):
    """The plan holds the grid; the batch is split over dp and the depth (Tesseract's layers), not over the grid,
    and the parameters are wrapped for data parallelism over the same axes (ddp over the depth alone)."""
    cfg, plan = validate_with_plan(compose_dict([f"+parallel={preset}"]))
    assert plan is not None and plan.mesh.shape == mesh
    assert (plan.grid.rows, plan.grid.cols, plan.grid.depth) == grid
    topo = plan.topology
    batch = (*dp_axes, *((grid[2],) if grid[2] else ()))
    assert topo.batch_axes == batch and topo.dp_size == (2 if batch else 1) and topo.repeats == 4
    wrapped = plan.param_data_parallel
    assert (wrapped.mode, wrapped.dim_names) == ("ddp", batch) if batch else wrapped is None


def test_a_grid_plan_travels_to_the_workers_unchanged():
    from parallel.plan.serial import plan_from_dict, plan_to_dict

    _, plan = validate_with_plan(compose_dict(["+parallel=tp2p5d"]))
    assert plan_from_dict(json.loads(json.dumps(plan_to_dict(plan)))) == plan
