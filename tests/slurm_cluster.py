"""A real Slurm on this host that the tests start and stop themselves: munged, slurmctld and slurmd.

    cluster = start_slurm(workdir)      # one node (this host: its CPUs and memory), partition "debug"
    env = {**os.environ, **cluster.env} # SLURM_CONF points sbatch / squeue / scontrol / srun at it
    cluster.stop()                      # every job cancelled, the daemons stopped, no process left behind

Debian's ``slurmctld``, ``slurmd`` and ``munge`` (22.05 on bookworm) are installed when missing (as
``.ci/run`` does; apt waits for its lock). The configuration is the smallest that runs in a container
without cgroups: ``ProctrackType=proctrack/linuxproc`` (the job's processes found by parentage, no
cgroup), ``TaskPlugin=task/none`` (no binding or cgroup confinement), ``SwitchType=switch/none``,
``MpiDefault=none``, no accounting (``sacct`` has nothing: the CLI reads ``scontrol show job``), and
``SlurmUser=root``, as the tests run as root. Everything else lives in ``workdir``: state, spool,
logs, the munge key (generated) and munged's socket (``AuthInfo=socket=...``), and the daemons listen
on free ports. ``cred_expire=10``: a requeued job waits that long before it may start again (Slurm's
default is 120 s).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.ports import free_port
from timing import Deadline, scaled

DAEMONS = ("munged", "slurmctld", "slurmd")
PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")
INSTALL_HINT = "apt-get install -y --no-install-recommends munge slurmctld slurmd slurm-client (.ci/run does)"
PARTITION = "debug"


def _have_binaries() -> bool:
    return all(shutil.which(name) or Path(f"/usr/sbin/{name}").exists() for name in DAEMONS + ("sbatch",))


def ensure_slurm() -> None:
    """Install Debian's Slurm and munge when missing (root only); skip the test when they still are
    (fail under ``CI=true``, where ``.ci/run`` installs them)."""
    import pytest

    from tests.pg import in_ci

    if not _have_binaries() and os.geteuid() == 0 and shutil.which("apt-get"):
        apt = ["env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "-q", "-o", "DPkg::Lock::Timeout=300"]
        subprocess.run([*apt, "update"], capture_output=True, timeout=scaled(600))
        subprocess.run([*apt, "install", "-y", "--no-install-recommends", *PACKAGES], capture_output=True,
                       timeout=scaled(900))
    if not _have_binaries():
        reason = f"Slurm is missing: no {'/'.join(DAEMONS)} or sbatch ({INSTALL_HINT})"
        if in_ci():
            pytest.fail(reason + "; under CI=true this is an error", pytrace=False)
        pytest.skip(reason)


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _memory_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 1024


@dataclass
class SlurmCluster:
    """One controller and one node, this host, on free ports; ``env`` is what a client needs."""

    root: Path
    node: str
    env: dict[str, str]
    daemons: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *words: str, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        done = subprocess.run(list(words), env={**os.environ, **self.env}, capture_output=True, text=True,
                              timeout=scaled(60))
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(words)}: exit {done.returncode}: {done.stderr}")
        return done

    def jobs(self) -> list[str]:
        """The ids of the jobs the controller has that have not ended."""
        out = self.run("squeue", "--noheader", "--format=%i", check=False).stdout
        return out.split()

    def stop(self) -> None:
        """Cancel every job, wait until none is left, stop the daemons (slurmd, slurmctld, munged)."""
        if self.jobs():
            self.run("scancel", "--full", *self.jobs(), check=False)
            deadline = Deadline(60)
            while self.jobs() and not deadline.expired():
                time.sleep(0.5)
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(timeout=scaled(30))
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
        self.daemons.clear()


def _write_conf(root: Path, node: str) -> Path:
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=meshflowtest",
        f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge/munge.sock,cred_expire=10",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd.log",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "ReturnToService=2",
        "MinJobAge=3600",  # an ended job stays in scontrol's view for the test to read
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=2",
        "KillWait=10",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={_memory_mib() * 9 // 10} State=UNKNOWN",
        f"PartitionName={PARTITION} Nodes={node} Default=YES MaxTime=INFINITE State=UP",
    ]) + "\n")
    return conf


def start_slurm(root: Path) -> SlurmCluster:
    """munged, slurmctld and slurmd in the foreground (our children), configured under ``root``; returns
    once the node is idle and a job can be submitted."""
    ensure_slurm()
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "munge").chmod(0o700)
    node = socket.gethostname().split(".")[0]
    conf = _write_conf(root, node)
    cluster = SlurmCluster(root=root, node=node, env={"SLURM_CONF": str(conf)})
    key = root / "munge" / "munge.key"
    subprocess.run([_sbin("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)
    logs = (root / "log" / "daemons.log").open("ab")
    commands = [
        [_sbin("munged"), "--foreground", "--force", f"--key-file={key}", f"--socket={root}/munge/munge.sock",
         f"--pid-file={root}/munge/munged.pid", f"--log-file={root}/log/munged.log", f"--seed-file={root}/munge/seed"],
        [_sbin("slurmctld"), "-D", "-i", "-f", str(conf)],
        [_sbin("slurmd"), "-D", "-N", node, "-f", str(conf)],
    ]
    try:
        for command in commands:
            cluster.daemons.append(subprocess.Popen(command, stdout=logs, stderr=subprocess.STDOUT,
                                                    env={**os.environ, **cluster.env}, start_new_session=True))
            if command[0].endswith("munged"):
                _wait_for(lambda: (root / "munge" / "munge.sock").exists(), "munged's socket", root)
        _wait_for(lambda: "idle" in cluster.run("sinfo", "--noheader", "--format=%T", check=False).stdout,
                  "the node to be idle", root)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_for(ready, what: str, root: Path) -> None:
    deadline = Deadline(60)
    while not ready():
        if deadline.expired():
            logs = "\n".join(f"{p.name}: {p.read_text()[-1500:]}" for p in sorted((root / "log").glob("*.log")))
            raise RuntimeError(f"Slurm did not start: waited for {what}\n{logs}")
        time.sleep(0.3)
