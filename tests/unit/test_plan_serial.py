"""A resolved plan written as JSON and read back is the same plan, field by field, for every kind of layout;
a worker whose own model differs from the plan's is refused with both fingerprints named.

    python -m pytest tests/unit/test_plan_serial.py -q -n 0
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from parallel.placements import PlacementSpec
from parallel.plan.serial import PlanMismatch, ResolvedPlan, model_fingerprint, plan_from_dict, plan_to_dict
from parallel.plan.spec import ParallelPlan
from trainer.config.compose import compose_dict
from trainer.models import build_model
from trainer.models.skeleton import meta_model
from trainer.validate.checks import validate_with_plan

PRESETS = {
    "3d": ["+parallel=3d", "mesh=[2,2,2]"],
    "fsdp": ["+parallel=fsdp", "mesh=[4]"],
    "tp_sp": ["+parallel=tp_sp", "mesh=[2]"],
    "cp": ["+parallel=cp", "mesh=[4]"],
    "ep": ["model=gpt_moe", "+parallel=ep", "mesh=[4]"],
    "3d_ep": ["model=gpt_moe", "+parallel=3d_ep", "mesh=[2,2,2]"],
    "per-stage layouts": ["+parallel=pp_stages", "mesh=[4]"],
    "interleaved": ["+parallel=3d", "mesh=[2,2,2]", "parallel.pipeline.schedule=Interleaved1F1B",
                    "parallel.pipeline.stages_per_rank=2", "parallel.pipeline.boundaries=auto"],
    "rank ids": ["+parallel=2d", "mesh=[[2,0],[3,1]]"],
    "one device": [],
}


def _plan(overrides: list[str]) -> tuple[ParallelPlan, object]:
    cfg, plan = validate_with_plan(compose_dict([*overrides, "tracking=none"]))
    assert plan is not None
    return plan, cfg


def _fields(plan: ParallelPlan) -> dict[str, object]:
    return {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_plan_read_back_from_json_equals_the_plan_on_every_field(preset):
    plan, _ = _plan(PRESETS[preset])
    written = plan_to_dict(plan)
    assert set(written) == {f.name for f in dataclasses.fields(ParallelPlan)}  # no field left behind
    read = plan_from_dict(json.loads(json.dumps(written)))
    assert read == plan
    assert _fields(read) == _fields(plan)
    assert read.topology == plan.topology
    assert read.sharded_axes == plan.sharded_axes and read.sequence_parallel_axes == plan.sequence_parallel_axes
    if plan.pipeline is not None and plan.pipeline.stages:
        assert [s.layout for s in read.pipeline.stages] == [s.layout for s in plan.pipeline.stages]
        assert [s.ranks for s in read.pipeline.stages] == [s.ranks for s in plan.pipeline.stages]


def test_the_3d_plan_file_holds_placements_as_the_config_writes_them():
    plan, cfg = _plan(PRESETS["3d"])
    written = json.loads(json.dumps(ResolvedPlan.of(plan, meta_model(cfg.model)).to_dict()))
    assert written["plan"]["placements"]["layers.0.attn.wq.weight"] == {"tp": "Shard(0)"}
    assert written["plan"]["placements"]["layers.0.attn.wo.weight"] == {"tp": "Shard(1)"}
    assert written["plan"]["pipeline"]["stage_units"][1][0] == "layers.2"
    assert written["plan"]["data_parallel"] == {"mode": "fsdp", "dim_names": ["dp"]}
    assert written["model"]["num_parameters"] == len(list(meta_model(cfg.model).parameters()))
    assert plan_from_dict(written["plan"]).placements["layers.0.attn.wq.weight"] == {"tp": PlacementSpec("shard", 0)}


def test_a_hugging_face_plan_reads_back_equal(tmp_path):
    pytest.importorskip("transformers")
    from tests.hf_assets import write_tiny_llama

    write_tiny_llama(tmp_path / "llama")
    plan, cfg = _plan(["model=hf", f"model.path={tmp_path / 'llama'}", "+parallel=3d", "mesh=[2,2,2]"])
    assert any(fqn.startswith("model.layers.") for fqn in plan.placements)
    assert plan_from_dict(json.loads(json.dumps(plan_to_dict(plan)))) == plan


def test_the_fingerprint_is_of_names_and_shapes_not_of_device_or_values():
    cfg = compose_dict(["tracking=none"])
    from trainer.config.schema import RunConfig

    model_cfg = RunConfig.model_validate(cfg).model
    meta, real = build_model(model_cfg, device="meta"), build_model(model_cfg, seed=3)
    assert model_fingerprint(meta) == model_fingerprint(real)
    fingerprint, count = model_fingerprint(real)
    assert len(fingerprint) == 16 and count == len(list(real.parameters()))
    wider = build_model(model_cfg.model_copy(update={"vocab_size": model_cfg.vocab_size + 8}), device="meta")
    assert model_fingerprint(wider)[0] != fingerprint and model_fingerprint(wider)[1] == count


def test_a_worker_whose_model_differs_is_refused_naming_both_fingerprints(tmp_path):
    plan, cfg = _plan(PRESETS["fsdp"])
    path = tmp_path / "resolved_plan.json"
    ResolvedPlan.of(plan, meta_model(cfg.model)).write(path)
    resolved = ResolvedPlan.read(path)
    assert resolved.plan_for(build_model(cfg.model, device="meta")) == plan
    other = build_model(cfg.model.model_copy(update={"n_layers": cfg.model.n_layers + 1}), device="meta")
    with pytest.raises(PlanMismatch) as err:
        resolved.plan_for(other)
    assert resolved.fingerprint in str(err.value) and model_fingerprint(other)[0] in str(err.value)
    assert f"({resolved.num_parameters} parameters)" in str(err.value)


def test_a_file_of_another_format_is_refused(tmp_path):
    plan, cfg = _plan(PRESETS["fsdp"])
    data = ResolvedPlan.of(plan, meta_model(cfg.model)).to_dict()
    with pytest.raises(ValueError, match="format 99"):
        ResolvedPlan.from_dict({**data, "format": 99})
