"""The submit path's validator (service.validation): identical submissions composed once, each job's
answer pointing at its own workdir, nothing cached that read a file; workers that leave with a server
killed by SIGKILL.

    python -m pytest tests/unit/test_validation.py -q
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from functools import partial

import pytest

from parallel.errors import ConfigError
from service.leftovers import WORKERS_DIR, end_leftovers
from service.limits import cap_memory_budget
from service.settings import Settings
from service.submit import resolve_config
from service.validation import Validator, cacheable
from timing import Deadline, scaled

TINY = ["+parallel=dp", "mesh=[2]", "train.steps=3", "train.seq_len=32", "train.global_batch_size=4"]


@pytest.fixture
def settings(tmp_path) -> Settings:
    settings = Settings(workspace=tmp_path / "ws", capacity=2, max_rank_memory_gb=4.0)
    (settings.workspace / "datasets" / "corpus").mkdir(parents=True)
    (settings.workspace / "datasets" / "corpus" / "a.txt").write_text("some text " * 200)
    return settings


def test_identical_submissions_share_one_validation_each_in_its_own_workdir(settings):
    validator = Validator(settings, workers=0)
    first = validator.resolve_job(overrides=TINY, document=None, workdir=settings.jobs_dir / "job-1")
    second = validator.resolve_job(overrides=TINY, document=None, workdir=settings.jobs_dir / "job-2")
    assert (validator.misses, validator.hits) == (1, 1)
    assert second.train.checkpoint.dir == str(settings.jobs_dir / "job-2" / "checkpoints")
    assert first.train.checkpoint.dir == str(settings.jobs_dir / "job-1" / "checkpoints")
    # The cached answer is exactly what validating for job-2 gives.
    fresh, _ = resolve_config(overrides=TINY, document=None, workspace=settings.workspace,
                              workdir=settings.jobs_dir / "job-2", tracking_uri=settings.mlflow_tracking_uri,
                              run_id=None, limit_raw=partial(cap_memory_budget, settings=settings))
    assert second.model_dump(mode="json") == fresh.model_dump(mode="json")
    assert second.launch.memory_budget_gb == 4.0
    _, cached_plan = validator.validate_job(overrides=TINY, document=None, workdir=settings.jobs_dir / "job-4")
    # a cached answer carries the plan validation resolved: the dp mesh of 2, for the model's fingerprint
    assert cached_plan is not None and cached_plan["plan"]["mesh"]["shape"] == [2]
    assert cached_plan["plan"]["data_parallel"] == {"mode": "ddp", "dim_names": ["dp"]}
    other = validator.resolve_job(overrides=[*TINY[:-1], "train.global_batch_size=8"], document=None,
                                  workdir=settings.jobs_dir / "job-3")
    assert other.train.global_batch_size == 8 and validator.misses == 2


def test_concurrent_identical_submissions_wait_for_the_first(settings):
    validator = Validator(settings, workers=0)
    results: dict[int, object] = {}
    gate = threading.Barrier(6)

    def submit(index: int) -> None:
        gate.wait()
        results[index] = validator.resolve_job(overrides=TINY, document=None, workdir=settings.jobs_dir / f"j{index}")

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert validator.misses == 1 and validator.coalesced + validator.hits == 5
    assert {results[i].launch.log_dir for i in range(6)} == {str(settings.jobs_dir / f"j{i}" / "logs")
                                                             for i in range(6)}


def test_refusals_and_configs_that_read_files_are_never_cached(settings):
    validator = Validator(settings, workers=0)
    for _ in range(2):
        with pytest.raises(ConfigError) as err:
            validator.resolve_job(overrides=[*TINY, "train.steps=0"], document=None, workdir=settings.jobs_dir / "x")
        assert [i.path for i in err.value.issues] == ["train.steps"]
    on_files = [*TINY, "data=text", "data.root=datasets/corpus", "data.glob=*.txt"]
    for name in ("a", "b"):
        cfg = validator.resolve_job(overrides=on_files, document=None, workdir=settings.jobs_dir / name)
        assert cfg.data.root == str(settings.workspace / "datasets" / "corpus")
    assert validator.hits == 0 and validator.misses == 4
    assert not cacheable(cfg.model_dump(mode="json"))
    assert not cacheable({"model": {"arch": "llama"}, "data": {"kind": "synthetic"}, "train": {"init_from": "/m"}})
    assert cacheable({"model": {"arch": "mlp"}, "data": {"kind": "regression"}, "train": {}})


def test_a_worker_process_validates_and_a_dead_one_is_replaced(settings):
    validator = Validator(settings, workers=1)
    validator.start()
    try:
        # The warm-up is a whole validation in the worker (readiness waits for it), and it ends.
        assert validator.wait_warm(timeout=scaled(300))
        assert [future.result() for future in validator._warming] == validator.worker_pids()
        in_pool = validator.resolve_job(overrides=TINY, document=None, workdir=settings.jobs_dir / "p1")
        local = Validator(settings, workers=0).resolve_job(overrides=TINY, document=None,
                                                           workdir=settings.jobs_dir / "p1")
        assert in_pool.model_dump(mode="json") == local.model_dump(mode="json")
        with pytest.raises(ConfigError) as err:  # a refusal crosses the process boundary with its path and fix
            validator.resolve_job(overrides=["mesh=[3]", "+parallel=dp"], document=None,
                                  workdir=settings.jobs_dir / "p2")
        assert err.value.issues and all(i.fix for i in err.value.issues)
        (pid,) = validator.worker_pids()
        os.kill(pid, signal.SIGKILL)  # out of memory, say: the next submission gets a fresh pool
        again = validator.resolve_job(overrides=[*TINY[:-1], "train.global_batch_size=8"], document=None,
                                      workdir=settings.jobs_dir / "p3")
        assert again.train.global_batch_size == 8
    finally:
        validator.stop()


def test_a_cluster_executor_lets_the_validator_accept_several_nodes(tmp_path):
    from service.settings import Settings
    from service.submit import MULTI_NODE_ENDPOINT
    from service.validation import _resolve

    overrides = ["+parallel=fsdp", "mesh=[4]", "launch.nnodes=2", "data=synthetic"]
    for executor, verdict in (("local", "invalid"), ("ray", "ok")):
        settings = Settings(workspace=tmp_path, executor=executor)
        answer = _resolve(overrides, None, workdir=settings.jobs_dir / "j", settings=settings)
        assert answer[0] == verdict, answer
    launch = answer[1]["config"]["launch"]
    assert launch["nnodes"] == 2 and launch["rdzv_endpoint"] == MULTI_NODE_ENDPOINT
    # the plan resolved there travels with the config (the job's launcher does not resolve it again)
    plan = answer[1]["plan"]["plan"]
    assert plan["mesh"]["shape"] == [4] and plan["data_parallel"]["mode"] == "fsdp"


# A server killed with SIGKILL cannot stop its pool: the workers leave on their own.
_SERVER = textwrap.dedent("""
    import sys
    from service.settings import Settings
    from service.validation import Validator

    validator = Validator(Settings(workspace=sys.argv[1]), workers=2)
    validator.start()
    validator.wait_warm()
    print(" ".join(map(str, validator.worker_pids())), flush=True)
    sys.stdin.read()  # until killed
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited; only its entry waits for a reaper
        return f.read().split(")")[-1].split()[0] != "Z"


def test_workers_leave_when_the_server_is_killed(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE,
                            text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        # Each worker recorded itself, for a restarted server to end should it outlive its server.
        assert sorted(int(p.name) for p in (tmp_path / WORKERS_DIR).iterdir()) == sorted(pids)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # Each worker looks for its parent once a second; 60 s is a generous bound, and scaled (tests/timing.py).
    deadline = Deadline(60)
    while any(_alive(p) for p in pids) and not deadline.expired():
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), pids
    assert end_leftovers(tmp_path) == [] and not any((tmp_path / WORKERS_DIR).iterdir())  # stale records tidied
