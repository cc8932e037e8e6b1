"""What bounds one plan (service/plans.py, service/limits.py, service/validation.py): size ceilings
checked before anything is planned, plans computed in a validation worker (not the server), a
time limit that replaces the worker, a memory limit that refuses the request.

    python -m pytest tests/unit/test_plan_limits.py -q
"""

from __future__ import annotations

import os
import resource

import pytest

import service.submit
from parallel.errors import ConfigError
from service.limits import check_size_ceilings
from service.plans import AutoPlanPage, compute_plan, plan_in_pool
from service.settings import Settings
from service.validation import Validator, limited, resolve_as_service
from timing import scaled

OVERSIZED = ["+parallel=dp", "mesh=[1000000]", "train.global_batch_size=1000000"]
SMALL = ["+parallel=fsdp", "mesh=[2]", "train.seq_len=32", "train.global_batch_size=4", "tracking.pictures=false"]
PICTURED = SMALL[:-1]  # the same plan with its pictures drawn


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(workspace=tmp_path / "ws", capacity=0, max_rank_memory_gb=4.0, max_world_size=64)


def test_an_oversized_request_is_refused_before_anything_is_planned(settings, monkeypatch):
    def never(*_, **__):
        raise AssertionError("planned although the ceilings refuse the request")

    monkeypatch.setattr(service.submit, "resolve_and_validate", never)
    with pytest.raises(ConfigError) as err:
        resolve_as_service(settings, overrides=OVERSIZED, document=None, workdir=settings.jobs_dir / "plan")
    mesh, batch = err.value.issues
    assert (mesh.path, batch.path) == ("mesh", "train.global_batch_size")
    assert mesh.reason == "needs 1000000 worker slots; this service's limit is 64 (max_world_size)"
    assert mesh.fix == "use a mesh of at most 64 devices, e.g. mesh=[64]"
    assert "65536 (max_global_batch_size)" in batch.reason and batch.fix == "use train.global_batch_size=65536 or less"
    # a plan's answer is the same refusal, as plain values
    kind, issues = compute_plan(OVERSIZED, None, workdir=settings.jobs_dir / "plan", settings=settings,
                                page=AutoPlanPage())
    assert kind == "invalid" and [i[0] for i in issues] == ["mesh", "train.global_batch_size"]


def test_size_ceilings_count_explicit_rank_ids_axes_capacity_and_microbatches(settings):
    def paths(raw: dict, **changes) -> list[tuple[str, str]]:
        return [(i.path, i.reason) for i in check_size_ceilings(raw, settings.model_copy(update=changes))]

    assert paths({"mesh": [8, 8]}) == []
    assert paths({"mesh": [[0, 1], [2, 3]]}) == []
    assert paths({"mesh": [8, 9]}) == [("mesh", "needs 72 worker slots; this service's limit is 64 (max_world_size)")]
    ids = [list(range(i * 40, i * 40 + 40)) for i in range(2)]  # 80 explicit ranks
    assert paths({"mesh": ids}) == [("mesh", "needs 80 worker slots; this service's limit is 64 (max_world_size)")]
    assert paths({"mesh": [4]}, capacity=2) == [("mesh", "needs 4 worker slots; this service's limit is 2 (capacity)")]
    assert paths({"mesh": [1] * 9}) == [("mesh", "has 9 axes; a mesh has at most 8")]
    assert paths({"parallel": {"pipeline": {"microbatches": 5000}}}) == [
        ("parallel.pipeline.microbatches", "5000 is above this service's limit of 1024 (max_microbatches)")]
    assert paths({"mesh": "[2]", "train": {"global_batch_size": True}}) == []  # the schema says what is wrong


def _allocate(gib: float, *, settings: Settings) -> tuple[str, int]:
    return "ok", len(bytearray(int(gib * 2**30)))


def test_the_memory_limit_refuses_the_request_and_is_lifted_after(settings):
    small = settings.model_copy(update={"plan_memory_gb": 0.25})
    before = resource.getrlimit(resource.RLIMIT_AS)
    kind, [(path, reason, fix)] = limited("<plan>", _allocate, 1.0, settings=small)
    assert (kind, path) == ("invalid", "<plan>") and "limit of 0.25 GiB of memory (plan_memory_gb)" in reason and fix
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    assert limited("<plan>", _allocate, 0.1, settings=small) == ("ok", int(0.1 * 2**30))
    assert _allocate(0.5, settings=small) == ("ok", 2**29)  # outside the block: no limit


def _pid(settings: Settings) -> int:
    return os.getpid()  # a warm-up that costs nothing: each worker's first plan here pays its imports


def test_a_plan_runs_in_a_pool_worker_and_one_past_the_time_limit_is_refused(settings):
    validator = Validator(settings, workers=1, warm_up=_pid)
    validator.start()
    try:
        assert validator.wait_warm(timeout=scaled(600))
        (worker,) = validator.worker_pids()
        answer = plan_in_pool(validator, owner="alice", overrides=SMALL, document=None, page=AutoPlanPage())
        assert answer.pid == worker and answer.pid != os.getpid()
        assert answer.numbers["world_size"] == 2 and answer.config["mesh"] == [2] and answer.numbers["per_pp_rank"]

        # No plan with its pictures is computed in 1 ms (0.23 s on an idle host): the worker is ended and
        # replaced. The pool looks at its clock between messages, every 0.1 s (pebble's sleep unit), so a
        # request answered within that tick is not stopped: the small plan alone (0.09 s warm) can be.
        validator.settings = settings.model_copy(update={"plan_timeout_s": 0.001})
        with pytest.raises(ConfigError) as err:
            plan_in_pool(validator, owner="alice", overrides=PICTURED, document=None, page=AutoPlanPage())
        [issue] = err.value.issues
        assert issue.path == "<plan>" and issue.reason.endswith("limit of 0.001 s (plan_timeout_s)") and issue.fix

        validator.settings = settings
        again = plan_in_pool(validator, owner="alice", overrides=SMALL, document=None, page=AutoPlanPage())
        assert again.numbers == answer.numbers and again.pid != worker
        assert again.pid in validator.worker_pids()
    finally:
        validator.stop()


@pytest.mark.parametrize("limit_gb", [21.18696, 4.0, 0.0015])
def test_the_budget_written_and_the_fix_printed_are_within_the_limit(limit_gb):
    """A limit that rounds up at 3 decimals (21.18696 -> 21.187): the budget the service writes, sent
    back as it is (a config read from GET /v1/jobs/{id}), and the value the refusal's fix names are
    both accepted; anything above the limit is still refused."""
    from service.limits import cap_memory_budget

    settings = Settings(capacity=0, max_rank_memory_gb=limit_gb)
    written = {"mesh": [1]}
    assert cap_memory_budget(written, settings) == []
    budget = written["launch"]["memory_budget_gb"]
    assert budget <= limit_gb and limit_gb - budget < 1e-3
    assert cap_memory_budget({"mesh": [1], "launch": {"memory_budget_gb": budget}}, settings) == []
    (refused,) = cap_memory_budget({"mesh": [1], "launch": {"memory_budget_gb": limit_gb + 0.01}}, settings)
    printed = float(refused.fix.rsplit(" ", 1)[1])
    assert f"limit of {refused.fix.rsplit(' ', 1)[1]} GiB" in refused.reason and printed <= limit_gb
    assert cap_memory_budget({"mesh": [1], "launch": {"memory_budget_gb": printed}}, settings) == []
