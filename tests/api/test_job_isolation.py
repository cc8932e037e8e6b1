"""What a running job can see and expose: its environment, its listening sockets, its files' modes;
and the CPU priority it runs at (below the server's, so the control plane stays responsive).

One real job (2 workers, dp) is looked at from outside through /proc while it trains, then cancelled.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from api_testkit import TINY, TOKENS, wait_for
from timing import Deadline

LOOPBACK_TCP = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it
LOOPBACK_TCP6 = {"00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}  # ::1, ::ffff:127.0.0.1


def group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return pids


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def niceness(pid: int) -> int:
    """Field 19 of /proc/<pid>/stat (the fields after the command name start at field 3)."""
    stat_line = Path(f"/proc/{pid}/stat").read_text()
    return int(stat_line[stat_line.rindex(")") + 2:].split()[16])


def listening_addresses(pids: list[int]) -> list[str]:
    """Local addresses of the TCP sockets in LISTEN state that these processes hold."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:["):-1])
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1])
    return found


def test_a_job_runs_without_secrets_on_loopback_with_private_files(server):
    overrides = [*TINY, "+parallel=dp", "mesh=[2]", "train.steps=2000"]
    with server.client("alice") as alice:
        response = alice.post("/v1/jobs", json={"name": "isolation", "overrides": overrides})
        assert response.status_code == 201, response.text
        job = response.json()
        job = wait_for(alice, job["id"], {"RUNNING"})
        log = Path(job["config"]["train"]["checkpoint"]["dir"]).parent / "job.log"
        silence, size = Deadline(180), 0  # a limit on a log that stops growing: the (niced) job is slow when busy
        while "workers: rank0=" not in (text := log.read_text(errors="replace")):  # the process group is up
            assert not silence.expired(), text[-3000:]
            if len(text) > size:
                size = len(text)
                silence.restart()
            time.sleep(0.5)
        pids = group_pids(job["pid"])
        assert len(pids) >= 4  # supervisor, launcher (the elastic agent), 2 workers
        try:
            listening = listening_addresses(pids)
            envs = [environ(pid) for pid in pids]
            nice_values = {niceness(pid) for pid in pids}
            autogroup = Path(f"/proc/{job['pid']}/autogroup")
            group_nice = autogroup.read_text().split()[-1] if autogroup.exists() else None
        finally:
            alice.post(f"/v1/jobs/{job['id']}/cancel")
        wait_for(alice, job["id"], {"CANCELLED"}, timeout=120)

    # rendezvous store, the workers' store and gloo: several sockets, every one on loopback
    assert len(listening) >= 2, listening
    assert all(a.split(":")[0] == LOOPBACK_TCP or a.split(":")[0] in LOOPBACK_TCP6 for a in listening), listening

    for env in envs:
        assert not [k for k in env if k.startswith("MESHFLOW_") and k != "MESHFLOW_CACHE_DIR"], sorted(env)
        assert not any(token in value for value in env.values() for token in TOKENS.values())
        assert not any("DATABASE" in k or "jobs.db" in v for k, v in env.items())
        assert env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")  # the job imports this checkout's code
        assert "PATH" in env and "HOME" in env

    # MESHFLOW_JOB_NICE (10): every process of the job, and its session's autogroup where the kernel has them
    assert nice_values == {min(19, os.nice(0) + 10)}, nice_values
    assert group_nice in ("10", None)

    workdir = log.parent
    assert stat.S_IMODE(workdir.stat().st_mode) == 0o700
    loose = [str(p) for p in workdir.rglob("*") if stat.S_IMODE(p.lstat().st_mode) & 0o077 and not p.is_symlink()]
    assert not loose, loose
    assert stat.S_IMODE((workdir / "job.json").stat().st_mode) == 0o600
