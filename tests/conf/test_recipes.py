"""Training recipes (``+recipe=<name>``, ``conf/recipe/``) and ``train.eval_at_start``'s validation.

A recipe is a ``# @package _global_`` file like a parallel preset: it composes with any
``+parallel=<preset>`` in either order, its values arrive unchanged, every key stays overridable
on the command line after it, and the control plane accepts it in a job's overrides. Asking for
an evaluation before step 1 without a validation split is refused with a fix that works when
typed exactly as printed.

Run: ``python -m pytest tests/conf/test_recipes.py -q``
"""

from __future__ import annotations

import re

import pytest
import yaml

from parallel.errors import ConfigError
from service.submit import check_overrides
from trainer.config.compose import CONF_DIR, compose_dict
from trainer.config.schema import RunConfig
from trainer.validate.checks import validate_config

RECIPES = sorted(p.stem for p in (CONF_DIR / "recipe").glob("*.yaml"))
PARALLEL = ("fsdp", "3d", "tp_sp")


def _leaves(node: dict, prefix: str = "") -> dict[str, object]:
    """``{"optim.lr": 2e-5, ...}``: a nested mapping's values by dotted path."""
    out = {}
    for key, value in node.items():
        path = f"{prefix}{key}"
        out.update(_leaves(value, f"{path}.") if isinstance(value, dict) else {path: value})
    return out


def _at(raw: dict, path: str):
    for key in path.split("."):
        raw = raw[key]
    return raw


def test_discovery_finds_the_recipes():
    assert "finetune" in RECIPES


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("preset", [None, *PARALLEL])
def test_recipe_composes_with_parallel_presets_in_any_order(recipe, preset):
    written = _leaves(yaml.safe_load((CONF_DIR / "recipe" / f"{recipe}.yaml").read_text()))
    orders = [[f"+recipe={recipe}"]] if preset is None else [
        [f"+recipe={recipe}", f"+parallel={preset}"], [f"+parallel={preset}", f"+recipe={recipe}"]]
    composed = [compose_dict(o) for o in orders]
    assert all(c == composed[0] for c in composed)  # the order of the two groups does not matter
    for path, value in written.items():
        assert _at(composed[0], path) == value, path
    cfg = validate_config(composed[0])
    if preset is not None:
        assert cfg.parallel is not None and cfg.tracking.tags["preset"] == preset


def test_finetune_values():
    cfg = validate_config(compose_dict(["+recipe=finetune"]))
    o, t = cfg.optim, cfg.train
    assert (o.lr, o.warmup_steps, o.warmup_fraction, o.schedule, o.weight_decay) == (2e-5, None, 0.03, "cosine", 0.01)
    assert o.warmup_steps_for(t.steps) == 3  # ceil(0.03 * 100)
    assert (t.grad_clip, t.checkpoint.save_final, t.eval_at_start) == (1.0, True, None)  # eval at start: auto
    assert cfg.model == RunConfig().model and cfg.data == RunConfig().data  # the model and data stay the user's


def test_finetune_keys_stay_overridable_after_it():
    overrides = ["+recipe=finetune", "optim.lr=1e-4", "optim.warmup_steps=5", "train.checkpoint.save_final=false",
                 "train.eval_at_start=false", "optim.weight_decay=0.0"]
    cfg = validate_config(compose_dict(overrides))
    assert (cfg.optim.lr, cfg.optim.warmup_steps_for(cfg.train.steps), cfg.optim.weight_decay) == (1e-4, 5, 0.0)
    assert cfg.train.checkpoint.save_final is False and cfg.train.eval_at_start is False


def test_control_plane_accepts_recipes():
    assert check_overrides(["+recipe=finetune", "+parallel=fsdp", "mesh=[2]", "optim.lr=1e-5"]) == []
    (issue,) = check_overrides(["+recipe=pretrain"])
    assert issue.path == "recipe" and "finetune" in issue.fix


def test_help_lists_the_recipe_group(capsys):
    from trainer.cli.help import print_help

    print_help()
    out = capsys.readouterr().out
    assert "+recipe={finetune}" in out
    assert "train.eval_at_start:" in out and "optim.warmup_fraction:" in out


# ------------------------------------------------------------------- train.eval_at_start


def _refusal(overrides: list[str], path: str):
    with pytest.raises(ConfigError) as err:
        validate_config(compose_dict(overrides))
    issues = [i for i in err.value.issues if i.path == path]
    assert issues, err.value.issues
    return issues[0]


def _typed_fixes(fix: str) -> list[str]:
    """The ``key=value`` overrides a fix names, as a user would copy them."""
    return re.findall(r"[A-Za-z_][\w.]*=[^\s,;)]+", fix)


@pytest.mark.parametrize(("data", "want"), [
    (["data=text"], "data.val_fraction=0.1"), (["data=synthetic"], "train.eval_at_start=false")])
def test_eval_at_start_without_a_split_is_refused_with_a_working_fix(data, want):
    overrides = [*data, "train.eval_at_start=true"]
    issue = _refusal(overrides, "train.eval_at_start")
    assert "no validation split" in issue.reason and data[0].split("=")[1] in issue.reason
    fixes = _typed_fixes(issue.fix)
    assert want in fixes, issue.fix
    typed = [f for f in fixes if f.split("=")[0] in _leaves(compose_dict(data))]  # not data=files: it needs paths
    assert want in typed
    for fix in typed:  # every fix of this command, typed after it as printed, validates
        cfg = validate_config(compose_dict([*overrides, fix]))
        assert cfg.train.eval_at_start is False or cfg.data.val_fraction == 0.1


def test_eval_at_start_auto_without_a_split_is_accepted():
    for data in ("data=text", "data=synthetic"):
        assert validate_config(compose_dict(["+recipe=finetune", data])).train.eval_at_start is None


def test_eval_at_start_with_a_split_is_accepted():
    cfg = validate_config(compose_dict(["train.eval_at_start=true", "data.val_fraction=0.1"]))
    assert cfg.train.eval_at_start is True and cfg.data.val_fraction == 0.1


def test_eval_at_start_under_zbv_is_refused():
    """ZBV cannot evaluate: with a split the schedule is refused, without one eval_at_start is."""
    zbv = ["+parallel=pp", "parallel.pipeline.schedule=ZBV", "parallel.pipeline.stages_per_rank=2",
           "train.eval_at_start=true"]
    assert "ZBV cannot evaluate" in _refusal([*zbv, "data.val_fraction=0.1"], "parallel.pipeline.schedule").reason
    assert _refusal(zbv, "train.eval_at_start").fix.startswith("add data.val_fraction=0.1")
