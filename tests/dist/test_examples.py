"""The seed examples in ``conf/examples/`` (OneFlow's and PaddlePaddle's), run as real gloo workers.

Each example is composed as ``python -m trainer +examples=<name>`` composes it, validated by the
trainer's validator, and built by ``trainer.run.build.build_parallel_model`` inside the workers (see
``example_checks``). The tests hold, on every rank: each parameter's placements per mesh axis and
local shard shape, the input/output shapes of every stage, the ``Partial`` output where the seed
says the output is a pending sum, the gathered values against one device, and 3 training steps
against one device (rel 1e-5). Paddle's explicit-id mesh ``[[2,4,5],[0,1,3]]`` is held by rank
id: which slices of the [4,3] weight each id holds. Two CLI runs: ``python -m trainer
+examples=pp_gpipe_tiny``, and ``+examples=unordered_rank_ids``, whose launcher reports
(torch rank, rank id, host, device, CPU affinity) for every worker.

    python -m pytest tests/dist/test_examples.py -q      # ~2 minutes on 2 cores

Four launches, one per world size the examples need (2, 4, 6 and 8 processes; the engine builds
its mesh over the whole world, so a 2-rank example cannot run inside a 4-rank process group),
started together with the CLI runs so that their start-ups overlap. The same launches also build
(without training) a few non-seed configs, ``BUILDS``: FSDP, zero2 and HSDP shards, which no seed
has. For every seed and build, the placement picture's slices (``parallel.plan.placement_map``,
computed from the plan alone) must equal each rank's real local shards.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from example_checks import launch
from parallel.plan.placement_map import param_slices
from tests.conftest import unprefixed
from timing import scaled
from trainer.config.compose import CONF_DIR, compose_dict
from trainer.run.loop import train
from trainer.run.metrics import NullProgress
from trainer.models import build_model
from trainer.tracking.tracker import NullTracker
from trainer.validate.checks import validate_config, validate_with_plan

pytestmark = pytest.mark.slow

REPO = CONF_DIR.parent
LOSS_REL_TOL = 1e-5
R, S0, S1, P = "Replicate", "Shard(0)", "Shard(1)", "Partial"


def stage(index, input_local, raw_placements, raw_local, raw_global, output_local) -> dict:
    """A stage as one rank sees it in its first forward: input, raw output (before the engine's
    own redistribution: a Partial shows here) and the plain tensor handed on."""
    return {"stage": index, "input_local": input_local,
            "raw_output": {"placements": raw_placements, "local": raw_local, "global": raw_global,
                           "dtensor": bool(raw_placements)},
            "output": {"dtensor": False, "local": output_local}}


def rank(params: dict, *stages: dict) -> dict:
    """``params``: ``{fqn: (placements per axis, local shape)}``."""
    return {"params": {n: {"placements": pl, "local": shape} for n, (pl, shape) in params.items()},
            "stages": list(stages)}


# Every example: world size and what each rank holds. Shapes per the comments in conf/examples.
OF_DP = rank({"w0": ({"dp": R}, [5, 8]), "w1": ({"dp": R}, [8, 3])}, stage(0, [2, 5], {}, [2, 3], [2, 3], [2, 3]))
OF_MP = rank({"w0": ({"mp": S1}, [5, 4]), "w1": ({"mp": S0}, [4, 3])},
             stage(0, [4, 5], {"mp": P}, [4, 3], [4, 3], [4, 3]))
OF_PP = [rank({"w0": ({}, [5, 8])}, stage(0, [2, 5], {}, [2, 8], [2, 8], [2, 8])),
         rank({"w1": ({}, [8, 3])}, stage(1, [2, 8], {}, [2, 3], [2, 3], [2, 3]))]
# Per-stage layouts: stage 0 dp on ranks 0-1, stage 1 mp on ranks 2-3. A micro-batch of 2 rows
# travels as one row per lane (the stage input and the handed-on output); stage 1 gathers both.
OF_MIXED = [rank({"w0": ({"dp": R}, [5, 8])}, stage(0, [1, 5], {}, [1, 8], [1, 8], [1, 8])),
            rank({"w1": ({"mp": S1}, [8, 3])}, stage(1, [1, 8], {"mp": S1}, [2, 3], [2, 6], [1, 6]))]
PD_DP = rank({"w0": ({"dp": R}, [1024, 4096]), "w1": ({"dp": R}, [4096, 1024])},
             stage(0, [4, 1024], {}, [4, 1024], [4, 1024], [4, 1024]))
PD_TP = rank({"w0": ({"mp": S1}, [1024, 2048]), "w1": ({"mp": S0}, [2048, 1024])},
             stage(0, [8, 1024], {"mp": P}, [8, 1024], [8, 1024], [8, 1024]))
PD_PP = [rank({"w0": ({}, [1024, 4096])}, stage(0, [4, 1024], {}, [4, 4096], [4, 4096], [4, 4096])),
         rank({"w1": ({}, [4096, 1024])}, stage(1, [4, 4096], {}, [4, 1024], [4, 1024], [4, 1024]))]
# Per-stage layouts, each stage a [2,2] dp x mp sub-mesh (dp: ddp, the seed's Replicate). A
# micro-batch of 4 rows travels as one row per lane; inside a stage each dp row holds 2 rows.
PD_3D = [rank({"w0": ({"dp": R, "mp": S1}, [1024, 2048])},
              stage(0, [1, 1024], {"mp": S1}, [2, 2048], [2, 4096], [1, 4096])),
         rank({"w1": ({"dp": R, "mp": S0}, [2048, 1024])},
              stage(1, [1, 4096], {"mp": P}, [2, 1024], [2, 1024], [1, 1024]))]
# Paddle's ProcessMesh([[2,4,5],[0,1,3]], ["x","y"]): every rank holds w0 [6,4] split over x and
# w1 [4,3] split [Shard(0), Shard(1)]; which piece is each rank id's (PADDLE_SLICES).
PD_MESH = rank({"w0": ({"x": S1, "y": R}, [6, 2]), "w1": ({"x": S0, "y": S1}, [2, 1])},
               stage(0, [4, 6], {"x": P, "y": S1}, [4, 1], [4, 3], [4, 3]))
EXPECTED = {
    "dp_tiny": [OF_DP] * 2,
    "tp_col_row_tiny": [OF_MP] * 2,
    "pp_gpipe_tiny": OF_PP,
    "stages_dp_then_tp": [OF_MIXED[0]] * 2 + [OF_MIXED[1]] * 2,  # stage 0 on ranks 0-1, stage 1 on 2-3
    "dp_8m": [PD_DP] * 2,
    "tp_col_row_8m": [PD_TP] * 2,
    "pp_1f1b_8m": PD_PP,
    "stages_dp_x_tp": [PD_3D[0]] * 4 + [PD_3D[1]] * 4,        # [[0,1],[2,3]] stage 0, [[4,5],[6,7]] stage 1
    "unordered_rank_ids": [PD_MESH] * 6,
}
# Paddle's example by rank id: (rows, columns) of w1 [4,3] and (rows, columns) of w0 [6,4].
PADDLE_SLICES = {
    2: ([[0, 2], [0, 1]], [[0, 6], [0, 2]]), 4: ([[0, 2], [1, 2]], [[0, 6], [0, 2]]), 5: ([[0, 2], [2, 3]], [[0, 6], [0, 2]]),
    0: ([[2, 4], [0, 1]], [[0, 6], [2, 4]]), 1: ([[2, 4], [1, 2]], [[0, 6], [2, 4]]), 3: ([[2, 4], [2, 3]], [[0, 6], [2, 4]]),
}
PADDLE_IDS_BY_RANK = [2, 4, 5, 0, 1, 3]  # torch rank = position in the row-major flattened mesh
# With layouts {"": {output: {mp: Partial}}} the output stays a pending sum: (placements, local shape).
# Not seeds, only built in the same launches (check_build): the data-parallel sharding no seed has.
# {name: (world size, overrides)}; what each must show is in test_placement_map_covers_fsdp_shards.
MLP = ["model=mlp", "data=regression", "model.hidden_features=8", "model.out_features=3", "train.global_batch_size=4"]
BUILDS = {
    "fsdp_uneven": (4, [*MLP, "+parallel=fsdp", "mesh=[4]", "model.in_features=5"]),   # w0 rows 2,2,1,0
    "zero2_uneven": (2, [*MLP, "+parallel=zero2", "mesh=[2]", "model.in_features=3"]),  # w0 rows 2,1
    "fsdp_tp": (8, ["+parallel=2d", "mesh=[4,2]"]),     # _StridedShard: each tp half of w1 [172,64] in 22,22,22,20 rows
    "hsdp_tp": (8, ["+parallel=hsdp_tp"]),
    "fsdp_pp_tp": (8, ["+parallel=3d"]),
    "pp_stages": (4, ["+parallel=pp_stages"]),          # stage 0 fsdp on ranks 0-1, stage 1 tp on 2-3
}
PARTIAL = {"tp_col_row_tiny": ({"mp": P}, [4, 3]), "tp_col_row_8m": ({"mp": P}, [8, 1024])}
CLI_RUNS = ["pp_gpipe_tiny", "unordered_rank_ids"]  # python -m trainer +examples=<name> tracking=none
NO_FINAL_SAVE = "train.checkpoint.save_final=false"  # the in-process runs compare losses; no checkpoint wanted


def example_files() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def configs() -> dict[str, dict]:
    return {name: compose_dict([f"+examples={name}", NO_FINAL_SAVE]) for name in EXPECTED}


@pytest.fixture(scope="module")
def build_configs() -> dict[str, dict]:
    return {name: compose_dict([*overrides, "tracking=none", NO_FINAL_SAVE]) for name, (_, overrides) in BUILDS.items()}


def world_of(name: str) -> int:
    return len(EXPECTED[name]) if name in EXPECTED else BUILDS[name][0]


@pytest.fixture(scope="module")
def launched(configs, build_configs, tmp_path_factory) -> dict:
    """One launch per world size (2, 4, 6, 8) and the CLI runs, all started at once: on 2 cores
    their start-ups overlap. ``{world size: [per-rank dicts]}`` and ``"cli"``: ``{example:
    (exit code, stdout, stderr)}``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    clis = {name: subprocess.Popen([sys.executable, "-m", "trainer", f"+examples={name}", "tracking=none"],
                                   cwd=tmp_path_factory.mktemp("cli"), env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
            for name in CLI_RUNS}
    worlds = sorted({world_of(name) for name in [*EXPECTED, *BUILDS]})
    with ThreadPoolExecutor(len(worlds)) as pool:
        futures = {
            world: pool.submit(launch, world_size=world, out_dir=tmp_path_factory.mktemp(f"w{world}"),
                               configs={n: raw for n, raw in configs.items() if world_of(n) == world},
                               builds={n: raw for n, raw in build_configs.items() if world_of(n) == world})
            for world in worlds
        }
        out: dict = {world: f.result() for world, f in futures.items()}
    out["cli"] = {}
    for name, cli in clis.items():
        stdout, stderr = cli.communicate(timeout=scaled(300))
        out["cli"][name] = (cli.returncode, stdout, stderr)
    return out


@pytest.fixture(scope="module")
def results(launched):
    """``results(name) -> [per-rank dict]``, failing on any rank's error."""

    def get(name: str) -> list[dict]:
        per_rank = [r[name] for r in launched[world_of(name)]]
        errors = [r["error"] for r in per_rank if not r["ok"]]
        assert not errors, errors[0]
        return per_rank

    return get


@pytest.fixture(scope="module")
def reference(configs) -> dict[str, list[float]]:
    """One device, same seed and global batch: ``mesh`` and ``parallel`` dropped (examples that
    then coincide, e.g. the four Paddle ones, are run once)."""
    runs: dict[str, list[float]] = {}
    out = {}
    for name, raw in configs.items():
        single = {**raw, "mesh": None, "parallel": None}
        key = json.dumps(single, sort_keys=True)
        if key not in runs:
            runs[key] = train(validate_config(single), tracker=NullTracker(), progress=NullProgress()).losses
        out[name] = runs[key]
    return out


def test_every_example_has_expectations():
    assert example_files() == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_composes_as_the_trainer_does(name, configs):
    cfg = validate_config(configs[name])
    assert (cfg.model.arch, cfg.data.kind, cfg.model.activation) == ("mlp", "regression", "none")
    assert cfg.world_size == len(EXPECTED[name])
    assert cfg.train.steps == 3


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_placements_and_local_shards(name, results):
    """Every parameter, every rank: placements per axis and local shard shape; the gathered
    values are the one-device initialisation."""
    for r, (got, want) in enumerate(zip(results(name), EXPECTED[name], strict=True)):
        shapes = {n: {"placements": p["placements"], "local": p["local"]} for n, p in got["params"].items()}
        assert shapes == want["params"], f"rank {r}"
        assert all(p["values_match"] for p in got["params"].values()), f"rank {r}: {got['params']}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_stage_input_and_output_shapes(name, results):
    """Input, raw output (placements, local and global shape) and handed-on output per stage:
    e.g. the model-parallel output is Partial before the engine all-reduces it."""
    for r, (got, want) in enumerate(zip(results(name), EXPECTED[name], strict=True)):
        assert got["stages"] == want["stages"], f"rank {r}"


@pytest.mark.parametrize("name", sorted(PARTIAL))
def test_partial_output_layout(name, results):
    """The seeds' w0 Shard(1) / w1 Shard(0) with no output redistribution: a Partial output
    whose sum over ranks is the one-device output."""
    placements, local = PARTIAL[name]
    for got in results(name):
        assert got["partial"]["placements"] == placements and got["partial"]["local"] == local
        assert got["partial"]["sum_rel_err"] < 1e-5


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_losses_match_one_device(name, results, reference):
    per_rank = results(name)
    losses = per_rank[0]["losses"]
    assert len(losses) == 3 and all(r["losses"] == losses for r in per_rank)
    for got, want in zip(losses, reference[name], strict=True):
        assert abs(got - want) <= LOSS_REL_TOL * abs(want), (losses, reference[name])


def test_cli_runs_the_pipeline_example(launched, reference):
    """``python -m trainer +examples=pp_gpipe_tiny tracking=none``: 2 workers, exit 0, the
    one-device losses in the summary line."""
    returncode, stdout, stderr = launched["cli"]["pp_gpipe_tiny"]
    assert returncode == 0, stderr[-3000:]
    losses = reference["pp_gpipe_tiny"]
    assert f"done: steps 1..3, loss {losses[0]:.4f} -> {losses[-1]:.4f} (single steps)" in stdout.splitlines(), stdout


def test_paddle_mesh_shards_by_rank_id(results):
    """Paddle's [4,3] tensor (w1) with [Shard(0), Shard(1)] on [[2,4,5],[0,1,3]]: id 2 holds rows
    0:2 of column 0, id 4 column 1, id 5 column 2, ids 0, 1, 3 rows 2:4 of columns 0, 1, 2, each
    with those slices' one-device values; w0's columns follow the mesh row (axis x)."""
    per_rank = results("unordered_rank_ids")
    assert [r["rank_id"] for r in per_rank] == PADDLE_IDS_BY_RANK
    for r in per_rank:
        w1_slices, w0_slices = PADDLE_SLICES[r["rank_id"]]
        w1, w0 = r["params"]["w1"], r["params"]["w0"]
        assert (w1["slices"], w0["slices"]) == (w1_slices, w0_slices), f"id {r['rank_id']}"
        assert w1["local_values_match"] and w0["local_values_match"], f"id {r['rank_id']}"


def test_cli_binds_each_rank_id_to_its_cpu(launched, reference):
    """``python -m trainer +examples=unordered_rank_ids``: the launcher numbers the workers by
    mesh position (torch rank r has id [2,4,5,0,1,3][r]), each runs on this host, on the CPU its
    id names (the id-th of the CPUs allowed, modulo their number), and the losses are one device's."""
    returncode, stdout, stderr = launched["cli"]["unordered_rank_ids"]
    assert returncode == 0, stderr[-3000:]
    line = next((x for x in map(unprefixed, stdout.splitlines()) if x.startswith("rank ids: ")), None)
    assert line is not None, stdout
    pattern = r"rank(\d+)=(\d+) \(host=(\S+) device=(\S+) cpus=([\d,]+)\)"
    workers = [(int(r), int(i), host, device, [int(c) for c in cpus.split(",")])
               for r, i, host, device, cpus in re.findall(pattern, line)]
    allowed = sorted(os.sched_getaffinity(0))
    assert workers == [(r, i, socket.gethostname(), "cpu", [allowed[i % len(allowed)]])
                       for r, i in enumerate(PADDLE_IDS_BY_RANK)], line
    losses = reference["unordered_rank_ids"]
    assert f"done: steps 1..3, loss {losses[0]:.4f} -> {losses[-1]:.4f} (single steps)" in stdout.splitlines(), stdout


# ------------------------------------------------------------------ the placement picture's slices


def _computed_slices(raw: dict) -> dict:
    """:func:`parallel.plan.placement_map.param_slices` of a config, from its plan and the meta model only."""
    cfg, plan = validate_with_plan(raw)
    model = build_model(cfg.model, device="meta")
    return param_slices(plan, {name: tuple(p.shape) for name, p in model.named_parameters()})


def _bare(placement: str) -> str:
    return placement.removesuffix("()")  # the recorded "Replicate", the plan's "Replicate()"


@pytest.mark.parametrize("name", sorted(EXPECTED) + sorted(BUILDS))
def test_placement_map_matches_local_shards(name, configs, build_configs, results):
    """The slices the placement picture draws, computed from the plan without a process group,
    are the slices every rank's real local shard covers (and holds the values of), parameter by
    parameter; a rank holds exactly the parameters the map gives it; on every axis of the real
    DTensor the map names the same placement (its other axes: Replicate)."""
    computed = _computed_slices({**configs, **build_configs}[name])
    for rank, got in enumerate(results(name)):
        held = {fqn: p.slices[rank] for fqn, p in computed.items() if rank in p.slices}
        recorded = {fqn: tuple(tuple(s) for s in p["slices"]) for fqn, p in got["params"].items()}
        assert held == recorded, f"rank {rank}"
        assert all(p["local_values_match"] for p in got["params"].values()), f"rank {rank}"
        for fqn, p in got["params"].items():
            mine = {axis: _bare(pl) for axis, pl in computed[fqn].placements.items()}
            assert {a: mine.get(a) for a in p["placements"]} == p["placements"], f"rank {rank} {fqn}"
            assert all(pl == "Replicate" for a, pl in mine.items() if a not in p["placements"]), f"rank {rank} {fqn}"


def test_placement_map_covers_fsdp_shards(build_configs, results):
    """The non-seed builds show what the map must get right: FSDP's torch.chunk shards (the last
    rank empty) and _StridedShard under tp on the same dim (uneven chunks of each tp half)."""
    by_rank = lambda name, fqn: [tuple(tuple(s) for s in r["params"][fqn]["slices"]) for r in results(name)]  # noqa: E731
    assert by_rank("fsdp_uneven", "w0") == [((0, 2), (0, 8)), ((2, 4), (0, 8)), ((4, 5), (0, 8)), ((5, 5), (0, 8))]
    assert by_rank("zero2_uneven", "w0") == [((0, 2), (0, 8)), ((2, 3), (0, 8))]
    # mesh [4,2] dp x tp: rank = 2 * dp + tp; tp half t is rows 86t..86t+86, cut in 22, 22, 22, 20
    rows = [r[0] for r in by_rank("fsdp_tp", "layers.0.mlp.w1.weight")]
    assert rows == [(0, 22), (86, 108), (22, 44), (108, 130), (44, 66), (130, 152), (66, 86), (152, 172)]
    placements = results("fsdp_tp")[0]["params"]["layers.0.mlp.w1.weight"]["placements"]
    assert placements == {"dp": S0, "tp": S0}  # the recorder reads _StridedShard(0) as Shard(0)
