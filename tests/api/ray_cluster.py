"""A real two-node Ray cluster on this machine for the Ray executor's tests: a head and a second node,
each a ``ray start --block`` in its own session with its own ports, CPUs and a custom resource.

Everything it starts is found again by its temp dir (every Ray process names its session
directory under it) and killed at the end; ``ray stop`` is never used (it stops every Ray
process on the machine, other people's included).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from ports import free_port
from timing import Deadline, scaled

IP = "127.0.0.1"


def _ports() -> list[str]:
    names = ["--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port"]
    return [arg for name in names for arg in (name, str(free_port()))]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def processes_matching(text: str) -> list[int]:
    """Live (non-zombie) processes whose command line or environment mentions ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            if text in _cmdline(int(entry.name)) or text.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    return parents


def with_descendants(roots: list[int]) -> list[int]:
    parents = _parents()
    found, frontier = set(roots), set(roots)
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return sorted(found)


def job_processes(job_id: str) -> list[int]:
    """A job's processes on every node: those naming it (the Ray driver's ``--job-id``, each launcher's
    ``--rdzv-id``) and all they started (torch's workers set their variables only after they start)."""
    return [pid for pid in with_descendants(processes_matching(job_id)) if is_alive(pid)]


def is_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class RayNode:
    process: subprocess.Popen
    name: str  # its custom resource: node0, node1

    def descendants(self) -> list[int]:
        """The node's processes: its ``ray start`` and everything below it (raylet, agents, workers)."""
        return with_descendants([self.process.pid])

    def raylet_pids(self) -> list[int]:
        return [pid for pid in self.descendants() if "/raylet" in _cmdline(pid).split(" ")[0]]


@dataclass
class RayCluster:
    # short: unix sockets
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="mfray", dir="/tmp")))
    gcs_port: int = field(default_factory=free_port)
    dashboard_port: int = field(default_factory=free_port)
    nodes: list[RayNode] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"http://{IP}:{self.dashboard_port}"

    def _start_node(self, name: str, args: list[str], env: dict[str, str]) -> RayNode:
        command = ["ray", "start", "--block", "--node-ip-address", IP, "--num-cpus", "2",
                   "--resources", json.dumps({name: 1}), *_ports(), *args]
        log = open(self.root / f"{name}.log", "ab")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        node = RayNode(process, name)
        self.nodes.append(node)
        return node

    def start(self, env: dict[str, str], timeout: float = 180.0) -> "RayCluster":
        env = {**env, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
        self._start_node("node0", ["--head", "--port", str(self.gcs_port), "--temp-dir", str(self.root),
                                   "--include-dashboard", "true", "--dashboard-host", IP,
                                   "--dashboard-port", str(self.dashboard_port),
                                   "--ray-client-server-port", str(free_port())], env)
        self._wait_for_nodes(1, timeout)
        self._start_node("node1", ["--address", f"{IP}:{self.gcs_port}"], env)
        self._wait_for_nodes(2, timeout)
        return self

    def alive_nodes(self) -> list[dict]:
        reply = httpx.get(f"{self.address}/nodes", params={"view": "summary"}, timeout=scaled(10)).json()
        summary = reply.get("data", {}).get("summary", [])
        return [n for n in summary if n.get("raylet", {}).get("state") == "ALIVE"]

    def node_id(self, name: str) -> str:
        """The Ray node id of the node holding the custom resource ``name``."""
        for node in self.alive_nodes():
            if name in node.get("raylet", {}).get("resourcesTotal", {}):
                return node["raylet"]["nodeId"]
        raise LookupError(f"no live Ray node has the resource {name}")

    def _wait_for_nodes(self, count: int, timeout: float) -> None:
        """Until ``count`` nodes are alive, or a node's ``ray start`` exited; ``timeout`` scaled (tests/timing.py)."""
        deadline = Deadline(timeout)
        while not deadline.expired():
            for node in self.nodes:
                if node.process.poll() is not None:
                    raise RuntimeError(f"ray start for {node.name} exited: "
                                       f"{(self.root / f'{node.name}.log').read_text()[-3000:]}")
            try:
                if len(self.alive_nodes()) >= count:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1)
        raise TimeoutError(f"the Ray cluster has not {count} live nodes after {deadline.seconds_scaled:.0f} s")

    def stop(self) -> None:
        """Kill what this cluster started, and nothing else."""
        for node in self.nodes:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(node.process.pid, sig)
                except ProcessLookupError:
                    pass
                try:
                    node.process.wait(timeout=scaled(15))
                    break
                except subprocess.TimeoutExpired:
                    continue
        for pid in processes_matching(str(self.root)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)
