"""Launch N real gloo processes once and run a whole suite of checks inside them.

Process start-up (~2-3 s each on a 2-core machine) dominates, so a suite runs many checks in
one launch, reusing one process group; each rank writes its results as JSON and the parent
reads them back:

    results = launch("two_rank", world_size=2, out_dir=tmp_path)   # [rank0 dict, rank1 dict]

``checks`` names the module (in tests/dist) whose ``SUITES`` hold the checks: ``dist_checks``
by default, ``compile_checks`` for the torch.compile suites.
"""

from __future__ import annotations

import importlib
import json
import os
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch.multiprocessing as mp
from trainer.launch.processes import START_METHOD, worker_server
from trainer.launch.rendezvous import LOOPBACK, loopback_store
from timing import scaled


@contextmanager
def group_store() -> Iterator[int]:
    """The port of a ``TCPStore`` the parent serves on loopback while the ranks run: its socket is
    bound before the port is handed out and held to the end, so no other process (another test
    worker's gloo pairs take ephemeral ports all the time) can take the port in between, as one
    could when rank 0 bound a port chosen free a moment earlier (CI saw EADDRINUSE)."""
    store = loopback_store(0, timeout=timedelta(seconds=scaled(300)))
    yield store.port
    del store


def join_group(rank: int, world_size: int, port: int, timeout_s: float) -> None:
    """Join the gloo group whose store the parent serves on ``port`` (:func:`group_store`)."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)


def _entry(rank: int, world_size: int, port: int, suite: str, out_dir: str, only: list[str] | None,
           checks_module: str = "dist_checks", timeout_s: float = 120) -> None:
    """Module-level so ``spawn`` can pickle it: one rank of one suite."""
    import torch

    torch.set_num_threads(1)  # 8 ranks on 2 cores: threads would only fight
    join_group(rank, world_size, port, timeout_s)
    checks = importlib.import_module(checks_module)  # tests/dist is on sys.path (pytest rootdir-relative import); spawn inherits it

    selected = [(name, check) for name, check in checks.SUITES[suite] if only is None or name in only]
    run_checks_and_exit([(name, lambda check=check: check(rank=rank, world_size=world_size)) for name, check in selected],
                        rank=rank, out_dir=out_dir)


def run_checks_and_exit(named_checks, *, rank: int, out_dir: str) -> None:
    """Run ``[(name, zero-argument check)]`` in order on this rank (all ranks in step), write
    ``rank<r>.json`` with each check's dict or its traceback, and leave the process."""
    import torch.distributed as dist

    results: dict = {}
    try:
        for name, check in named_checks:
            try:
                results[name] = {"ok": True, **check()}
            except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
                results[name] = {"ok": False, "error": traceback.format_exc()}
            dist.barrier()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.barrier()
        # Leave without tearing down: after many meshes and pipeline schedules in one process,
        # gloo's destructors sometimes abort ("terminate called without an active exception")
        # once every result is already written; that is not a check failing.
        os._exit(0)


def launch(suite: str, *, world_size: int, out_dir: Path, only: list[str] | None = None,
           checks: str = "dist_checks", timeout_s: float = 120) -> list[dict]:
    """Run ``<checks>.SUITES[suite]`` (or the checks named in ``only``) on ``world_size``
    processes; the per-rank result dicts. ``timeout_s`` bounds every collective's wait (raise
    it where ranks compile: one rank may wait for another's compilation); idle-host seconds, scaled
    here by the host's slowness (tests/timing.py), so the workers need not measure it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with worker_server(), group_store() as port:  # forked from one server that imported torch and the trainer
        mp.start_processes(_entry, args=(world_size, port, suite, str(out_dir), only, checks, scaled(timeout_s)),
                           nprocs=world_size, join=True, start_method=START_METHOD)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


class SuiteResults:
    """Each suite of ``<checks>.SUITES`` launched once, when a test first asks for one of its checks;
    ``results(check)`` is every rank's dict of that check, a rank's error raised as the test's failure.

        results = SuiteResults(SUITES, {"two_rank": 2}, checks="chat_checks", tmp=tmp_path_factory)
    """

    def __init__(self, suites: dict[str, list], world_size: dict[str, int], *, checks: str, tmp,
                 timeout_s: float = 300) -> None:
        self.suite_of = {name: suite for suite, named in suites.items() for name, _ in named}
        self.world_size, self.checks, self.tmp, self.timeout_s = world_size, checks, tmp, timeout_s
        self.launched: dict[str, list[dict]] = {}

    def __call__(self, check: str) -> list[dict]:
        suite = self.suite_of[check]
        if suite not in self.launched:
            self.launched[suite] = launch(suite, world_size=self.world_size[suite], out_dir=self.tmp.mktemp(suite),
                                          checks=self.checks, timeout_s=self.timeout_s)
        per_rank = [r[check] for r in self.launched[suite]]
        errors = [r["error"] for r in per_rank if not r["ok"]]
        assert not errors, errors[0]
        return per_rank


def max_rel(values, expected) -> float:
    """The largest relative difference of two equally long sequences of numbers."""
    return max(abs(v - e) / abs(e) for v, e in zip(values, expected, strict=True))


def one_device_figures(raw_config: Callable[[str], dict]) -> Callable[[str], dict[str, list[float]]]:
    """One device's figures of the trainer's loop (``losses``, ``aux_losses``, ``grad_norms``) for the config
    ``raw_config(key)`` composes, each key's computed when first asked for: the reference a suite's ranks equal.

        references = one_device_figures(lambda model: compose_dict([f"model={model}", "data=synthetic"]))
    """
    from trainer.run.loop import train
    from trainer.run.metrics import NullProgress
    from trainer.tracking.tracker import NullTracker
    from trainer.validate.checks import validate_config

    cache: dict[str, dict[str, list[float]]] = {}

    def figures(key: str) -> dict[str, list[float]]:
        if key not in cache:
            cfg = validate_config(raw_config(key), check_model=False)
            result = train(cfg, tracker=NullTracker(), progress=NullProgress(), predicted_peak_mib=0.0)
            cache[key] = {"losses": result.losses, "aux_losses": result.aux_losses, "grad_norms": result.grad_norms}
        return cache[key]

    return figures
