"""One meshflow job on a Ray cluster: the Ray job's entrypoint (the driver), which the RayExecutor submits.

    python -m service.executors.ray_driver --job-id ID --world-size 4 --workdir DIR --config <base64 zlib JSON>

It reserves a placement group of ``launch.nnodes`` bundles of ``world_size / nnodes`` CPUs each
(STRICT_SPREAD over distinct Ray nodes when there are several), puts a :class:`NodeAgent` actor in
each bundle, and has agent ``k`` run that node's torch elastic agent:
``python -m trainer.launch <config> --node-rank k --rdzv-endpoint <agent 0's node IP>:<free port>
--rdzv-id <job id>``, in its own process group. The driver prints node 0's output as it is and the
other nodes' prefixed ``[node k]``: that is the Ray job's log, which the control plane copies into
the job's ``job.log``. Its exit code is the job's: 0 when every node finished, the first failing
node's code otherwise, 143 when stopped. When it fails, its last line starts with
:data:`REASON_PREFIX` and names the node (its rank, Ray node id and address).

SIGTERM (``ray job stop``) stops every node: SIGTERM to each launcher's group, SIGKILL after the
grace period. A launcher also gets SIGTERM (``PR_SET_PDEATHSIG``) when its agent dies with its
node or its job, and torch's workers get SIGINT when their launcher dies, so nothing outlives it.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from service.runner import PLAN_NAME as PLAN_FILE  # the name the launcher looks for beside job.json

REASON_PREFIX = "meshflow ray: "
EXIT_STOPPED = 143
STOP_GRACE_ENV = "MESHFLOW_RAY_STOP_GRACE_S"
PR_SET_PDEATHSIG = 1


def encode_config(config: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(zlib.compress(json.dumps(config).encode())).decode()


def decode_config(text: str) -> dict[str, Any]:
    return json.loads(zlib.decompress(base64.urlsafe_b64decode(text.encode())))


@contextlib.contextmanager
def plan_package(plan: dict[str, Any] | None) -> Iterator[Path | None]:
    """A folder holding only ``plan`` as :data:`PLAN_FILE`, for a Ray job's ``working_dir`` (Ray uploads it with
    the job and starts the driver in it), removed on leaving; None without a plan."""
    if plan is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="meshflow-ray-plan-") as folder:
        (Path(folder) / PLAN_FILE).write_text(json.dumps(plan))
        yield Path(folder)


def carried_plan() -> dict[str, Any] | None:
    """The plan :func:`plan_package` sent, in the driver (whose working directory is the package), or None."""
    path = Path.cwd() / PLAN_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _die_with_parent() -> None:
    """In the launcher, before exec: its own session, and SIGTERM when the agent that started it dies."""
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class NodeAgent:
    """One node of the job (a Ray actor in one bundle): runs the trainer's launcher and keeps its output."""

    def __init__(self, node_rank: int) -> None:
        self.node_rank = node_rank
        self.process: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._started = threading.Event()

    def where(self) -> tuple[str, str]:
        """(Ray node id, IP address) of this agent's node."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket() as probe:
            probe.bind(("", 0))
            return probe.getsockname()[1]

    def start(self, config: dict[str, Any], args: list[str], workdir: str, plan: dict[str, Any] | None = None) -> int:
        """Start the launcher, with ``plan`` (the one resolved at submission) beside its config; its pid. The
        thread that starts it lives as long as it does (the parent-death signal follows the thread that forked)."""
        folder = Path(tempfile.mkdtemp(prefix="meshflow-node-"))
        config_path = folder / "job.json"
        config_path.write_text(json.dumps(config))
        if plan is not None:
            (folder / PLAN_FILE).write_text(json.dumps(plan))
        command = [sys.executable, "-m", "trainer.launch", str(config_path), *args]
        cwd = workdir if os.path.isdir(workdir) else str(folder)
        threading.Thread(target=self._run, args=(command, cwd, folder), daemon=True).start()
        self._started.wait()
        return self.process.pid if self.process else -1

    def _run(self, command: list[str], cwd: str, folder: Path) -> None:
        try:
            self.process = subprocess.Popen(command, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, preexec_fn=_die_with_parent, text=True,
                                            errors="replace", bufsize=1, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except OSError as err:
            self._lines.append(f"could not start the launcher: {err}\n")
            self.exit_code = 127
            return
        finally:
            self._started.set()
        assert self.process.stdout is not None, "opened with stdout=PIPE"
        for line in self.process.stdout:
            with self._lock:
                self._lines.append(line)
        code = self.process.wait()
        for name in ("job.json", PLAN_FILE):
            (folder / name).unlink(missing_ok=True)
        folder.rmdir()
        self.exit_code = 128 - code if code < 0 else code

    def drain(self) -> tuple[list[str], int | None]:
        """The output since the last call, and the exit code once the launcher has ended."""
        code = self.exit_code  # read first: lines appended before the end are then in this batch
        with self._lock:
            lines, self._lines = self._lines, []
        return lines, code

    def stop(self, force: bool = False) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL if force else signal.SIGTERM)
            except ProcessLookupError:
                pass


def run(config: dict[str, Any], *, job_id: str, world_size: int, workdir: str, stop_grace_s: float,
        plan: dict[str, Any] | None = None) -> int:
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # RAY_ADDRESS comes from the job; the agents' output comes through drain()
    ray.init(log_to_driver=False, logging_level=logging.WARNING)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    nnodes = int(config.get("launch", {}).get("nnodes", 1))
    per_node = world_size // nnodes
    bundles = [{"CPU": per_node} for _ in range(nnodes)]
    group = placement_group(bundles, strategy="STRICT_SPREAD" if nnodes > 1 else "PACK")
    ready, _ = ray.wait([group.ready()], timeout=1.0)
    if not ready:  # it waits, as a queued job does, until the cluster has room (or the job is cancelled)
        print(f"waiting for {nnodes} Ray node(s) with {per_node} free CPUs each ...", flush=True)
    while not ready and not stopping.is_set():
        ready, _ = ray.wait([group.ready()], timeout=1.0)
    if stopping.is_set():
        return EXIT_STOPPED
    remote_agent = ray.remote(NodeAgent)
    # Actor handles: their methods are called through .remote(), which ray's types do not show.
    agents: list[Any] = [remote_agent.options(num_cpus=per_node, max_concurrency=4, max_restarts=0,
                                   scheduling_strategy=PlacementGroupSchedulingStrategy(group, k)).remote(k)
              for k in range(nnodes)]
    nodes = ray.get([agent.where.remote() for agent in agents])
    endpoint = config["launch"]["rdzv_endpoint"]  # one node: the trainer's loopback rendezvous
    if nnodes > 1:
        endpoint = f"{nodes[0][1]}:{ray.get(agents[0].free_port.remote())}"
    print(f"{nnodes} node(s) on Ray: " + ", ".join(f"node {k} = {node_id[:12]} ({ip})" for k, (node_id, ip)
                                                    in enumerate(nodes)) + f"; rendezvous at {endpoint}", flush=True)
    for k, agent in enumerate(agents):
        args = ["--node-rank", str(k), "--rdzv-endpoint", endpoint, "--rdzv-id", job_id]
        ray.get(agent.start.remote(config, args, workdir, plan))
    return _watch(agents, nodes, stopping, stop_grace_s)


def _describe(k: int, nnodes: int, node: tuple[str, str]) -> str:
    return f"node {k} of {nnodes} (Ray node {node[0]} at {node[1]})"


def _watch(agents: list, nodes: list[tuple[str, str]], stopping: threading.Event, stop_grace_s: float) -> int:
    """Forward the nodes' output until all have ended; stop them all when one fails or we are stopped.
    A node that died is blamed before one that exited with an error (its peers' collectives break
    when it goes, so they often exit first)."""
    import ray

    codes: dict[int, int | None] = {}  # node rank -> exit code (None: the node died)
    deaths: list[str] = []
    exits: list[tuple[str, int]] = []
    stop_sent_at: float | None = None
    while len(codes) < len(agents):
        for k, agent in enumerate(agents):
            if k in codes:
                continue
            try:
                lines, code = ray.get(agent.drain.remote(), timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                codes[k] = None
                first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
                deaths.append(f"{_describe(k, len(agents), nodes[k])} died ({type(err).__name__}: {first_line})")
                continue
            prefix = "" if k == 0 else f"[node {k}] "
            if lines:
                sys.stdout.write("".join(prefix + line for line in lines))
                sys.stdout.flush()
            if code is not None:
                codes[k] = code
                if code != 0 and not (stopping.is_set() or deaths or exits):
                    exits.append((f"{_describe(k, len(agents), nodes[k])} exited with code {code}", code))
        if (deaths or exits or stopping.is_set()) and stop_sent_at is None:
            stop_sent_at = time.monotonic()
            for k, agent in enumerate(agents):
                if k not in codes:
                    agent.stop.remote()
        elif stop_sent_at is not None and time.monotonic() - stop_sent_at > stop_grace_s:
            for k, agent in enumerate(agents):
                if k not in codes:
                    agent.stop.remote(force=True)
            stop_sent_at = float("inf")  # killed once
        time.sleep(0.2)
    if deaths:
        print(REASON_PREFIX + deaths[0], flush=True)
        return 1
    if exits:
        print(REASON_PREFIX + exits[0][0], flush=True)
        return exits[0][1]
    return EXIT_STOPPED if stopping.is_set() else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.executors.ray_driver")
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--workdir", required=True, help="the job's directory (the nodes' cwd where it exists)")
    parser.add_argument("--config", required=True, help="the resolved config, as encode_config() writes it")
    args = parser.parse_args(argv)
    grace = float(os.environ.get(STOP_GRACE_ENV, "10"))
    return run(decode_config(args.config), job_id=args.job_id, world_size=args.world_size, workdir=args.workdir,
               stop_grace_s=grace, plan=carried_plan())


if __name__ == "__main__":
    sys.exit(main())
