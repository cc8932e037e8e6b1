"""Jobs on a Ray cluster: each job is one Ray job (Ray's Jobs API) whose driver places the nodes.

    ray start --head --port=6379 --dashboard-port=8265 --num-cpus=4      # and on every other host:
    ray start --address=<head>:6379 --num-cpus=4
    MESHFLOW_EXECUTOR=ray MESHFLOW_RAY_ADDRESS=http://<head>:8265 python -m api

Why the Jobs API (``JobSubmissionClient``) and not remote tasks from the control plane: the
control plane never becomes a Ray driver (no ``ray.init`` in the API process, nothing of the
job's lifetime tied to it), so a job outlives a control-plane restart by construction; the ref
kept in the job row is the submission id (``meshflow-<job id>``, deterministic, so a job
submitted just before a crash is found again by its id alone); status, exit code, logs and stop
are plain HTTP calls to the cluster's dashboard. The driver the job runs,
:mod:`service.executors.ray_driver`, does the placement: a placement group with one bundle per
node (``launch.nnodes``, STRICT_SPREAD), each bundle running that node's torch elastic agent
with the rendezvous on the first bundle's node.

The job's config travels inside the Ray job (no shared filesystem is needed to start it), and the plan
resolved at submission in the job's runtime env (a ``working_dir`` of one file, which Ray uploads to the
cluster; the entrypoint would be too long for a large model's placements); its
``job.log`` here is filled from the Ray job's log as the scheduler polls. Paths in the config
(checkpoints, per-rank logs, a SQLite MLflow store) must be reachable from every Ray node,
e.g. a workspace on a shared filesystem; an MLflow server avoids the last one.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, ClassVar

from service import runner
from service.executors.base import Executor, JobLaunch, JobStatus
from service.settings import Settings
from service.executors.ray_driver import EXIT_STOPPED, REASON_PREFIX, STOP_GRACE_ENV, encode_config, plan_package
from service.submit import without_credentials

log = logging.getLogger(__name__)

# The environment of a job's Ray processes: the service's allow-listed job env (runner.job_environment),
# less what describes this host rather than the job (each Ray node has its own).
HOST_ONLY = runner.HOST_ENV_NAMES
ENDED = {"SUCCEEDED", "FAILED", "STOPPED"}
HEADER = b"Running entrypoint for job "  # Ray's first line of a job's log (the entrypoint, config included)


def submission_id(job_id: str) -> str:
    return f"meshflow-{job_id}"


class RayExecutor(Executor):
    """Start, watch and stop jobs through a Ray cluster's job-submission address."""

    name: ClassVar[str] = "ray"

    def __init__(self, address: str, *, stop_grace_s: float = 10.0, log_interval_s: float = 1.0) -> None:
        self.address = address
        self.stop_grace_s = stop_grace_s
        self.log_interval_s = log_interval_s
        self._client = None
        self._log_synced: dict[str, float] = {}  # ref -> when its log was last copied

    @classmethod
    def from_settings(cls, settings: Settings) -> RayExecutor:
        return cls(settings.ray_address, stop_grace_s=settings.cancel_grace_s)

    @property
    def client(self):
        if self._client is None:
            try:
                from ray.job_submission import JobSubmissionClient
            except ModuleNotFoundError:
                raise RuntimeError("MESHFLOW_EXECUTOR=ray needs Ray's client: pip install 'meshflow[ray]'") from None
            try:
                self._client = JobSubmissionClient(self.address)
            except (ConnectionError, RuntimeError, ValueError) as err:
                raise ConnectionError(f"MESHFLOW_RAY_ADDRESS={self.address}: no Ray cluster answers there ({err}); "
                                      "start one (ray start --head) or set the address its dashboard listens "
                                      "on") from None
        return self._client

    # ------------------------------------------------------------------ interface

    def start(self, launch: JobLaunch) -> str:
        launch.workdir.mkdir(mode=runner.DIR_MODE, parents=True, exist_ok=True)
        runner.write_job_config(launch.workdir, launch.config, launch.resolved_plan)  # the record, as for a local job
        runner.write_private(launch.workdir / runner.LOG_NAME, "")
        ref = submission_id(launch.job_id)
        # The entrypoint is shown by Ray's dashboard and heads the job's log: the config goes without
        # credentials (stored so; rows from before, too), which reach the job in its runtime env only.
        config = without_credentials(launch.config)
        entrypoint = (f"python -m service.executors.ray_driver --job-id {launch.job_id} --world-size "
                      f"{launch.world_size} --workdir {launch.workdir} --config {encode_config(config)}")
        env = {k: v for k, v in launch.env.items() if k not in HOST_ONLY}
        # The driver needs the grace to stop the nodes itself before Ray's job supervisor kills it.
        env.update({STOP_GRACE_ENV: str(self.stop_grace_s),
                    "RAY_JOB_STOP_WAIT_TIME_S": str(int(self.stop_grace_s) + 15)})
        with plan_package(launch.resolved_plan) as package:
            runtime_env: dict[str, Any] = {"env_vars": env}
            if package is not None:
                runtime_env["working_dir"] = str(package)
            self.client.submit_job(entrypoint=entrypoint, submission_id=ref, runtime_env=runtime_env,
                                   metadata={"meshflow_job_id": launch.job_id})
        return ref

    def poll(self, ref: str, launch: JobLaunch) -> JobStatus:
        try:
            info = self.client.get_job_info(ref)
        except RuntimeError as err:
            if "404" in str(err) or "does not exist" in str(err):
                return JobStatus(alive=False, reason=f"the Ray cluster at {self.address} has no job {ref} "
                                                     "(was the cluster restarted?)")
            raise
        except ConnectionError as err:  # the cluster is away for now: the job is not known to be over
            log.warning("job %s: Ray cluster %s unreachable (%s); still RUNNING", launch.job_id, self.address, err)
            return JobStatus(alive=True)
        status = str(getattr(info.status, "value", info.status))
        ended = status in ENDED
        self._sync_log(ref, launch.workdir, force=ended)
        if not ended:
            return JobStatus(alive=True)
        self._log_synced.pop(ref, None)
        code = info.driver_exit_code
        if code is None and status != "SUCCEEDED":
            code = EXIT_STOPPED if status == "STOPPED" else None
        reason = None
        if status == "FAILED":
            reason = self._reason(launch.workdir) or (info.message or "").strip() or "the Ray job failed"
        return JobStatus(alive=False, exit_code=0 if status == "SUCCEEDED" else code, reason=reason)

    def stop(self, ref: str, *, force: bool = False) -> None:
        # Ray's job supervisor sends the driver SIGTERM (which stops every node's process group) and
        # SIGKILLs it after RAY_JOB_STOP_WAIT_TIME_S; asking again changes nothing, which is right for force.
        try:
            self.client.stop_job(ref)
        except RuntimeError as err:
            log.warning("stopping Ray job %s: %s", ref, err)

    def adopt(self, launch: JobLaunch) -> str | None:
        ref = submission_id(launch.job_id)
        try:
            self.client.get_job_info(ref)
        except RuntimeError:
            return None
        return ref

    # ---------------------------------------------------------------------- logs

    def _sync_log(self, ref: str, workdir: Path, *, force: bool) -> None:
        """Append what the Ray job logged since the last copy to ``job.log`` (at most every
        ``log_interval_s``; always at the end). What is there already is the offset, so a restarted
        control plane continues where the last one stopped."""
        now = time.monotonic()
        if not force and now - self._log_synced.get(ref, 0.0) < self.log_interval_s:
            return
        self._log_synced[ref] = now
        raw = self.client.get_job_logs(ref).encode()
        header = raw.find(HEADER)
        if header < 0:
            return  # the driver has not started yet
        body = raw[raw.index(b"\n", header) + 1:] if b"\n" in raw[header:] else b""
        path = workdir / runner.LOG_NAME
        written = path.stat().st_size if path.exists() else 0
        if len(body) > written:
            with open(path, "ab") as f:
                f.write(body[written:])

    @staticmethod
    def _reason(workdir: Path) -> str | None:
        """The driver's last word on a failure: which node, and how it ended."""
        lines = runner.log_tail(workdir, 50).splitlines()
        return next((line.removeprefix(REASON_PREFIX) for line in reversed(lines) if line.startswith(REASON_PREFIX)),
                    None)
