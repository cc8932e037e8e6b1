"""A config validated elsewhere (the control plane's job.json) launches with the plan resolved there: the runner
writes it beside job.json, ``python -m trainer.launch`` reads it and checks it against its meta model instead of
resolving the plan again; a plan for another model is resolved again."""

from __future__ import annotations

import json
import stat
from dataclasses import replace

import pytest

import trainer.tracking.run_record as run_record
from parallel.plan.serial import ResolvedPlan
from service.runner import PLAN_NAME, write_job_config
from trainer.config.compose import compose_dict
from trainer.config.schema import RunConfig
from trainer.launch.elastic import PLAN_FILE
from trainer.launch.launcher import stored_plan


@pytest.fixture(scope="module")
def cfg() -> RunConfig:
    return RunConfig.model_validate(compose_dict(["+parallel=fsdp", "mesh=[2]", "tracking=none"]))


@pytest.fixture(scope="module")
def resolved(cfg) -> ResolvedPlan:
    plan = run_record.launch_plan(cfg)
    assert plan is not None
    return plan


def _no_resolving(*args, **kwargs):
    raise AssertionError("resolve_plan called for a config whose plan was stored")


def test_the_runner_writes_the_plan_beside_job_json_and_the_launcher_reads_it(cfg, resolved, tmp_path):
    assert PLAN_NAME == PLAN_FILE  # the file the server writes is the one the launcher looks for
    config_path = write_job_config(tmp_path, cfg.model_dump(mode="json"), resolved.to_dict())
    assert stat.S_IMODE((tmp_path / PLAN_NAME).stat().st_mode) == 0o600
    assert stored_plan(config_path) == resolved
    write_job_config(tmp_path, cfg.model_dump(mode="json"), None)  # a job without one leaves no stale file
    assert not (tmp_path / PLAN_NAME).exists() and stored_plan(config_path) is None


def test_a_damaged_plan_file_is_set_aside(tmp_path, capsys):
    (tmp_path / PLAN_FILE).write_text(json.dumps({"format": 99}))
    assert stored_plan(tmp_path / "job.json") is None
    assert "not used, the plan is resolved again" in capsys.readouterr().err


def test_the_launcher_uses_a_stored_plan_without_resolving(cfg, resolved, monkeypatch):
    monkeypatch.setattr(run_record, "resolve_plan", _no_resolving)
    assert run_record.launch_plan(cfg, ResolvedPlan.from_dict(resolved.to_dict())) == resolved


def test_a_plan_stored_for_another_model_is_resolved_again(cfg, resolved, caplog):
    stale = replace(resolved, fingerprint="0" * 16)
    again = run_record.launch_plan(cfg, stale)
    assert again == resolved and again.fingerprint != stale.fingerprint
    assert "resolving the plan again: the stored plan was resolved for a model with fingerprint 0000" in caplog.text


def test_a_store_made_before_plans_were_kept_gains_the_column(tmp_path):
    from sqlalchemy import create_engine, inspect, text

    from service.store import create_tables

    engine = create_engine(f"sqlite:///{tmp_path / 'jobs.db'}")
    create_tables(engine)
    with engine.begin() as connection:  # the table as an older version made it
        connection.execute(text("ALTER TABLE jobs DROP COLUMN resolved_plan"))
    assert "resolved_plan" not in {c["name"] for c in inspect(engine).get_columns("jobs")}
    create_tables(engine)  # a newer server starting on it
    columns = {c["name"]: c for c in inspect(engine).get_columns("jobs")}
    assert columns["resolved_plan"]["nullable"] and str(columns["resolved_plan"]["type"]) == "JSON"
