"""``train.compile: true``: compiled runs give the eager losses on one device, fsdp and 3d, their
checkpoints load into eager runs and back, and the validator refuses what cannot work.

    python -m pytest tests/dist/test_compile.py -q     # ~2-4 min on 2 cores (Inductor's cache warm / cold)

Two launches (2 and 8 processes; see ``compile_checks.SUITES``) each build their models the
trainer's way (``trainer.run.build.build_parallel_model`` with ``train.compile=true``) and train 5
steps; the eager single-device reference runs in this (parent) process. Compilation dominates:
the first step of each model compiles its block (~30 s of one core with a cold Inductor cache,
~3 s warm; the cache lives in /tmp/torchinductor_$USER). The 3d launch compiles on 8 processes
at once, hence the long collective timeout. The validator checks need no process at all.
"""

from __future__ import annotations

import os

import pytest

from compile_checks import CKPT_DIR_ENV, SUITES
from dist_checks import MLP_CFG, llama_cfg, reference_run
from dist_harness import launch
from parallel.errors import ConfigError
from trainer.config.schema import LlamaConfig
from trainer.models import build_model
from trainer.validate.checks import validate_config

WORLD_SIZE = {"two_rank": 2, "eight_rank": 8}
SUITE_OF = {name: suite for suite, checks in SUITES.items() for name, _ in checks}
LOSS_REL_TOL = 1e-5
COLLECTIVE_TIMEOUT_S = 900  # a rank waits in a collective while another compiles, 8 ranks on 2 cores
_launched: dict[str, list[dict]] = {}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """``results(check) -> [per-rank dict]``; each suite is launched once, when first needed."""

    def get(check: str) -> list[dict]:
        suite = SUITE_OF[check]
        if suite not in _launched:
            os.environ[CKPT_DIR_ENV] = str(tmp_path_factory.mktemp("checkpoints"))
            try:
                _launched[suite] = launch(suite, world_size=WORLD_SIZE[suite], out_dir=tmp_path_factory.mktemp(suite),
                                          checks="compile_checks", timeout_s=COLLECTIVE_TIMEOUT_S)
            finally:
                os.environ.pop(CKPT_DIR_ENV, None)
        per_rank = [r[check] for r in _launched[suite]]
        errors = [r["error"] for r in per_rank if not r["ok"]]
        assert not errors, errors[0]
        return per_rank

    return get


@pytest.fixture(scope="module")
def reference():
    return {"llama": reference_run(llama_cfg()), "mlp": reference_run(MLP_CFG)}


def _max_rel(values, expected) -> float:
    return max(abs(v - e) / abs(e) for v, e in zip(values, expected, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("check", ["single", "single_mlp", "fsdp", "fsdp_ac_full", "tp_sp_ac_full_every2", "3d"])
def test_compiled_losses_equal_eager(check, results, reference):
    """5 AdamW steps compiled give the eager single-device losses and gradient norms (rel 1e-5),
    and the evaluation loss after them; Dynamo compiled the blocks with no graph break."""
    per_rank = results(check)
    ref = reference["mlp" if check.endswith("mlp") else "llama"]
    losses = per_rank[0]["losses"]
    assert all(r["losses"] == losses for r in per_rank), "ranks disagree on the reduced loss"
    assert _max_rel(losses, ref["losses"]) <= LOSS_REL_TOL, (losses, ref["losses"])
    for r in per_rank:
        assert _max_rel(r["grad_norms"], ref["grad_norms"]) <= LOSS_REL_TOL, (r["grad_norms"], ref["grad_norms"])
        assert _max_rel([r["eval_loss"]], [ref["eval_loss"]]) <= LOSS_REL_TOL
        # One graph for training, one for evaluation's no-grad forward: nothing fell back to eager.
        assert r["unique_graphs"] >= 2 and r["graph_breaks"] == 0, r
    assert all(r["mesh_is_none"] for r in per_rank) == check.startswith("single")


BLOCKS = [f"layers.{i}" for i in range(4)]
COMPILED = {  # the modules compiled, over all ranks: each block, or the block inside its AC wrapper
    "single": BLOCKS, "fsdp": BLOCKS, "3d": BLOCKS, "single_mlp": [""],
    "fsdp_ac_full": [f"{b}._checkpoint_wrapped_module" for b in BLOCKS],
    "tp_sp_ac_full_every2": ["layers.0", "layers.1._checkpoint_wrapped_module", "layers.2",
                           "layers.3._checkpoint_wrapped_module"],
}


@pytest.mark.slow
@pytest.mark.parametrize("check", list(COMPILED))
def test_each_block_is_compiled(check, results):
    """Per block (inside activation checkpointing's wrapper, which stays eager); the mlp, which has
    no blocks, whole. Under a pipeline each rank compiles the blocks of its own stage."""
    per_rank = results(check)
    assert sorted(set().union(*(r["compiled"] for r in per_rank))) == COMPILED[check]
    if check == "3d":  # boundaries [layers.2]: pp rank 0 holds layers.0-1, pp rank 1 layers.2-3
        assert [r["compiled"] for r in per_rank][:4] == [BLOCKS[:2], BLOCKS[:2], BLOCKS[2:], BLOCKS[2:]]


@pytest.mark.slow
@pytest.mark.parametrize("check", ["single", "fsdp", "3d"])
def test_compiled_parameter_names_are_the_models(check, results):
    """No ``_orig_mod`` (nor any other wrapper segment) in any rank's parameter names: the union
    over the ranks is exactly the eager model's."""
    full = sorted(n for n, _ in build_model(LlamaConfig(), device="meta").named_parameters())
    assert sorted(set().union(*(r["fqns"] for r in results(check)))) == full


@pytest.mark.slow
def test_checkpoints_move_between_compiled_and_eager(results, reference):
    """fsdp: 2 steps, save, load into a fresh model of the other kind, 3 more steps: the 5 losses
    are the uninterrupted run's; the saved keys are identical and free of ``_orig_mod``."""
    per_rank = results("checkpoint_cross")
    for r in per_rank:
        to_eager, to_compiled = r["compiled_to_eager"], r["eager_to_compiled"]
        for run in (to_eager, to_compiled):
            assert _max_rel(run["losses"], reference["llama"]["losses"]) <= LOSS_REL_TOL, run["losses"]
            assert run["extra_step"] == 2
            assert not [k for k in run["keys"] + run["module_keys"] if "_orig_mod" in k or "_checkpoint" in k]
        assert to_eager["keys"] == to_compiled["keys"]
        assert "model.layers.0.attn.wq.weight" in to_eager["keys"]
        assert to_compiled["unique_graphs"] >= 1  # the loading side did compile


# ---------------------------------------------------------------------------- validator


def _no_compiler(monkeypatch, tmp_path, *, keep: tuple[str, ...] = ()) -> None:
    """PATH holds only the executables named in ``keep`` (as empty scripts); $CXX is unset."""
    for name in keep:
        exe = tmp_path / name
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)


def _issues(raw: dict) -> list:
    with pytest.raises(ConfigError) as excinfo:
        validate_config(raw, check_model=False)
    return [i for i in excinfo.value.issues if i.path == "train.compile"]


def test_compile_refused_without_a_cxx_compiler(monkeypatch, tmp_path):
    _no_compiler(monkeypatch, tmp_path)
    (issue,) = _issues({"train": {"compile": True}})
    assert "needs a C++ compiler" in issue.reason and "no g++, c++ or clang++ on PATH" in issue.reason
    assert issue.fix == "install a C++ compiler, e.g. apt-get install g++, or set train.compile=false"
    validate_config({"train": {"compile": False}}, check_model=False)  # eager needs none


def test_compile_refused_when_cxx_names_nothing(monkeypatch, tmp_path):
    _no_compiler(monkeypatch, tmp_path, keep=("g++",))
    monkeypatch.setenv("CXX", "my-missing-g++")
    (issue,) = _issues({"train": {"compile": True}})
    assert "'my-missing-g++'" in issue.reason and "unset it to use g++" in issue.fix


def test_compile_wants_cxx_set_when_only_clang_exists(monkeypatch, tmp_path):
    """Inductor looks for $CXX, else g++ only: a lone clang++ needs CXX=clang++."""
    _no_compiler(monkeypatch, tmp_path, keep=("clang++",))
    (issue,) = _issues({"train": {"compile": True}})
    assert "found clang++" in issue.reason and "export CXX=clang++" in issue.fix
    monkeypatch.setenv("CXX", "clang++")
    assert validate_config({"train": {"compile": True}}, check_model=False).train.compile


def test_compile_accepted_with_g_plus_plus(monkeypatch, tmp_path):
    _no_compiler(monkeypatch, tmp_path, keep=("g++",))
    assert validate_config({"train": {"compile": True}}, check_model=False).train.compile


def test_compile_check_imports_nothing():
    """The compiler check runs at validation time in the launcher: ``shutil.which`` only, no
    module is imported by it (torch's compiler stack least of all)."""
    import sys

    from trainer.config.schema import RunConfig
    from trainer.validate.checks import _check_compile

    cfg = RunConfig.model_validate({"train": {"compile": True}})
    before = set(sys.modules)
    assert _check_compile(cfg) == []  # this machine has g++
    assert set(sys.modules) - before == set()
