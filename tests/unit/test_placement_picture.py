"""The placement picture and table: a valid PNG, a JSON table that reads back into the same
groups, many groups merged into their distinct patterns, and the dry run writing both (or not,
with ``tracking.pictures=false``).

    python -m pytest tests/unit/test_placement_picture.py -q
"""

from __future__ import annotations

import json

import matplotlib.image
import pytest

from parallel.plan.placement_map import placement_groups_from_table, stage_grids
from trainer.config.compose import compose_dict
from trainer.pictures.placement import MAX_SEPARATE, _rows, placement_report, write_placement
from trainer.validate.checks import validate_with_plan

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _plan(*overrides: str):
    return validate_with_plan(compose_dict([*overrides, "tracking=none"]))


@pytest.mark.parametrize("example", ["stages_dp_then_tp", "unordered_rank_ids"])
def test_writes_a_png_and_a_table_that_reads_back(example, tmp_path):
    cfg, plan = _plan(f"+examples={example}")
    paths = write_placement(cfg, plan, tmp_path / "out")
    assert set(paths) == {"png", "json"}
    assert paths["png"].read_bytes()[:8] == PNG_SIGNATURE
    height, width, _ = matplotlib.image.imread(paths["png"]).shape
    assert width > 800 and height > 300  # two rows: one per (group, stage)
    groups, table = placement_report(cfg, plan)
    assert json.loads(paths["json"].read_text()) == table
    assert placement_groups_from_table(json.loads(paths["json"].read_text())) == groups


def test_table_of_stages_dp_then_tp():
    """Stage 0 (ranks 0, 1, dp) holds w0 whole on both; stage 1 (ranks 2, 3, mp) splits w1's columns."""
    cfg, plan = _plan("+examples=stages_dp_then_tp")
    _, table = placement_report(cfg, plan)
    assert table["groups"] == {
        "w0": [{"stage": 0, "params": ["w0"], "shape": [5, 8], "placements": {"dp": "Replicate()"},
                "ranks": {"0": [[0, 5], [0, 8]], "1": [[0, 5], [0, 8]]}}],
        "w1": [{"stage": 1, "params": ["w1"], "shape": [8, 6], "placements": {"mp": "Shard(1)"},
                "ranks": {"2": [[0, 8], [0, 3]], "3": [[0, 8], [3, 6]]}}]}
    assert [(s["ranks"], s["dim_names"]) for s in table["stages"]] == [([0, 1], ["dp"]), ([2, 3], ["mp"])]


def test_many_groups_merge_into_their_distinct_patterns():
    """gpt_debug on dp x tp: 12 groups, 3 patterns (dp-sharded 1-D, column and row parallel: the embedding's
    vocabulary rows split as a column-parallel weight's); every group still drawn, in its pattern's row."""
    cfg, plan = _plan("+parallel=2d", "mesh=[2,2]")
    groups, _ = placement_report(cfg, plan)
    assert len(groups) > MAX_SEPARATE
    rows, left_out = _rows(groups, stage_grids(plan))
    assert not left_out and len(rows) == 3
    assert sorted(g.name for row in rows for g in row.groups) == sorted(g.name for g in groups)
    column = next(row for row in rows if any(g.name == "layers.*.attn.wq.weight" for g in row.groups))
    assert {g.name for g in column.groups} == {f"layers.*.attn.w{x}.weight" for x in "qkv"} | {
        "layers.*.mlp.w1.weight", "layers.*.mlp.w3.weight", "output.weight", "tok_embeddings.weight"}  # loss parallel


def test_dry_run_writes_the_picture_unless_switched_off(tmp_path, monkeypatch, capsys):
    from trainer.cli.job import _write_pictures

    monkeypatch.chdir(tmp_path)
    cfg, plan = _plan("+examples=stages_dp_x_tp")
    _write_pictures(cfg, plan)
    out = capsys.readouterr().out.splitlines()
    assert out == [f"placement picture: {tmp_path.resolve() / 'meshflow-plan' / 'placement.png'}",
                   f"placement table: {tmp_path.resolve() / 'meshflow-plan' / 'placement.json'}"]
    assert (tmp_path / "meshflow-plan" / "placement.png").read_bytes()[:8] == PNG_SIGNATURE

    cfg, plan = _plan("+examples=stages_dp_x_tp", "tracking.pictures=false")
    (tmp_path / "meshflow-plan" / "placement.png").unlink()
    _write_pictures(cfg, plan)
    assert capsys.readouterr().out == "" and not (tmp_path / "meshflow-plan" / "placement.png").exists()


def test_experts_are_drawn_split_over_ep_then_dp():
    """fsdp x ep [2, 2] (rank = 2 dp + ep): an expert stack is Shard(0) over ep, then FSDP's Shard(0) over dp
    cuts each ep rank's half, as the engine places it (tests/dist/test_experts.py holds the real shards);
    every other parameter is FSDP-sharded over dp x ep flattened."""
    cfg, plan = _plan("model=gpt_moe", "+parallel=fsdp_ep", "mesh=[2,2]")
    groups = placement_report(cfg, plan)[1]["groups"]
    (experts,), (gate,) = groups["layers.*.mlp.experts.w1"], groups["layers.*.mlp.router.gate.weight"]
    assert experts["placements"] == {"dp": "Shard(0)", "ep": "Shard(0)"}
    assert {r: s[0] for r, s in experts["ranks"].items()} == {"0": [0, 2], "1": [4, 6], "2": [2, 4], "3": [6, 8]}
    assert gate["placements"] == {"dp_ep": "Shard(0)"}
    assert {r: s[0] for r, s in gate["ranks"].items()} == {"0": [0, 2], "1": [2, 4], "2": [4, 6], "3": [6, 8]}
