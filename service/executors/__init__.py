"""Executors: where and how the scheduler's jobs run (``MESHFLOW_EXECUTOR=local | ray | kubernetes | slurm``).

    executor = make_executor(settings)          # the one the settings name
    ref = executor.start(launch)                # JobLaunch: job id, workdir, resolved config, env
    executor.poll(ref, launch).alive            # ... until it has ended: exit code and reason
    executor.stop(ref)                          # SIGTERM everywhere; stop(ref, force=True) kills

``local`` (the default) needs nothing beyond this package; ``ray`` needs the ``ray`` extra
(``pip install meshflow[ray]``) and a running cluster; ``kubernetes`` the official client and a
cluster; ``slurm`` Slurm's client commands (sbatch, squeue, scontrol, scancel) on this host. Each is
imported only when chosen.
"""

from __future__ import annotations

import importlib

from service.executors.base import Executor, JobLaunch, JobStatus
from service.settings import Settings

__all__ = ["EXECUTORS", "Executor", "JobLaunch", "JobStatus", "ExecutorUnavailable", "make_executor"]

# name -> "module:Class", imported on first use (ray and kubernetes pull in large client libraries).
EXECUTORS: dict[str, str] = {
    "local": "service.executors.local:LocalExecutor",
    "ray": "service.executors.ray:RayExecutor",
    "kubernetes": "service.executors.kubernetes:KubernetesExecutor",
    "slurm": "service.executors.slurm:SlurmExecutor",
}
EXTRAS = {"ray": "ray", "kubernetes": "kubernetes"}


class ExecutorUnavailable(RuntimeError):
    """The configured executor cannot be loaded (not installed, or not part of this build)."""


def executor_class(name: str) -> type[Executor]:
    """The class serving ``name``, imported now; a clear error when it is unknown or not installed."""
    if name not in EXECUTORS:
        raise ExecutorUnavailable(f"MESHFLOW_EXECUTOR={name!r}: no such executor; use one of {', '.join(EXECUTORS)}")
    module_name, _, class_name = EXECUTORS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name == module_name:
            raise ExecutorUnavailable(f"MESHFLOW_EXECUTOR={name}: this build has no {module_name} module; "
                                      "use MESHFLOW_EXECUTOR=local, or install a meshflow that includes it") from None
        raise ExecutorUnavailable(f"MESHFLOW_EXECUTOR={name}: its client library is missing ({err.name}); "
                                  f"install it with pip install 'meshflow[{EXTRAS.get(name, name)}]'") from None
    return getattr(module, class_name)


def make_executor(settings: Settings, name: str | None = None) -> Executor:
    """The executor the settings choose (or the one called ``name``: a job an earlier server
    started with another executor is still watched by that one). Each is built from the
    settings: ``cls.from_settings(settings)``."""
    return executor_class(name or settings.executor).from_settings(settings)
