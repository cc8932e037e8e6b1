"""The seed examples in ``conf/examples/`` (OneFlow's and PaddlePaddle's), run as real gloo workers.

Each example is composed as ``python -m trainer +examples=<name>`` composes it, validated by the
trainer's validator, and built by ``trainer.loop.build_parallel_model`` inside the workers (see
``example_checks``). The tests hold, on every rank: each parameter's placements per mesh axis and
local shard shape, the input/output shapes of every stage, the ``Partial`` output where the seed
says the output is a pending sum, the gathered values against one device, and 3 training steps
against one device (rel 1e-5). One CLI run checks ``python -m trainer +examples=oneflow_pipeline``.

    python -m pytest tests/dist/test_examples.py -q      # ~1 minute on 2 cores

Three launches, one per world size the examples need (2, 4 and 8 processes; the engine builds its
mesh over the whole world, so a 2-rank example cannot run inside a 4-rank process group), started
together with the CLI run so that their start-ups overlap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from example_checks import launch
from trainer.compose import CONF_DIR, compose_dict
from trainer.loop import train
from trainer.metrics import NullProgress
from trainer.tracking import NullTracker
from trainer.validate import validate_config

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
EXPECTED = {
    "oneflow_data_parallel": [OF_DP] * 2,
    "oneflow_model_parallel": [OF_MP] * 2,
    "oneflow_pipeline": OF_PP,
    "oneflow_mixed": [OF_MIXED[0]] * 2 + [OF_MIXED[1]] * 2,   # stage 0 on ranks 0-1, stage 1 on 2-3
    "paddle_data_parallel": [PD_DP] * 2,
    "paddle_tensor_parallel": [PD_TP] * 2,
    "paddle_pipeline": PD_PP,
    "paddle_3d": [PD_3D[0]] * 4 + [PD_3D[1]] * 4,             # [[0,1],[2,3]] stage 0, [[4,5],[6,7]] stage 1
}
# With layouts {"": {output: {mp: Partial}}} the output stays a pending sum: (placements, local shape).
PARTIAL = {"oneflow_model_parallel": ({"mp": P}, [4, 3]), "paddle_tensor_parallel": ({"mp": P}, [8, 1024])}
CLI_ARGS = ["+examples=oneflow_pipeline", "tracking=none"]


def example_files() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def configs() -> dict[str, dict]:
    return {name: compose_dict([f"+examples={name}"]) for name in EXPECTED}


@pytest.fixture(scope="module")
def launched(configs, tmp_path_factory) -> dict:
    """One launch per world size (2, 4, 8) and the CLI run, all started at once: on 2 cores
    their start-ups overlap. ``{world size: [per-rank dicts]}`` and ``"cli"``: the process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cli = subprocess.Popen([sys.executable, "-m", "trainer", *CLI_ARGS], cwd=tmp_path_factory.mktemp("cli"),
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    worlds = sorted({len(ranks) for ranks in EXPECTED.values()})
    with ThreadPoolExecutor(len(worlds)) as pool:
        futures = {
            world: pool.submit(launch, world_size=world, out_dir=tmp_path_factory.mktemp(f"w{world}"),
                               configs={n: raw for n, raw in configs.items() if len(EXPECTED[n]) == world})
            for world in worlds
        }
        out: dict = {world: f.result() for world, f in futures.items()}
    stdout, stderr = cli.communicate(timeout=180)
    out["cli"] = (cli.returncode, stdout, stderr)
    return out


@pytest.fixture(scope="module")
def results(launched):
    """``results(name) -> [per-rank dict]``, failing on any rank's error."""

    def get(name: str) -> list[dict]:
        per_rank = [r[name] for r in launched[len(EXPECTED[name])]]
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
    """``python -m trainer +examples=oneflow_pipeline tracking=none``: 2 workers, exit 0, the
    one-device losses in the summary line."""
    returncode, stdout, stderr = launched["cli"]
    assert returncode == 0, stderr[-3000:]
    losses = reference["oneflow_pipeline"]
    assert f"done: steps 1..3, loss {losses[0]:.4f} -> {losses[-1]:.4f}" in stdout.splitlines(), stdout
