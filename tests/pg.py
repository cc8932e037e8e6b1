"""A real PostgreSQL server that the tests start and stop themselves (no server is assumed running).

    server = start_postgres(workdir)         # initdb + pg_ctl start on 127.0.0.1:<free port>
    url = server.create_database("jobs_1")   # postgresql+psycopg://meshflow:<pw>@127.0.0.1:<port>/jobs_1
    server.stop()                            # pg_ctl stop -m fast, and the data directory removed

The fixtures in ``tests/conftest.py`` wrap it: ``postgres`` (one server for the whole session) and
``postgres_url`` (a fresh database per test).

Binaries: ``initdb`` / ``pg_ctl`` on PATH, else the newest ``/usr/lib/postgresql/<version>/bin``
(Debian's layout; ``.ci/run`` installs Debian's ``postgresql`` where they are missing). Without
them a test skips, except under ``CI=true``, where it fails and says PostgreSQL is missing.

Running as root: ``initdb`` and ``postgres`` refuse to run as root, so the server then runs as
an unprivileged user (``postgres`` where that account exists, else ``nobody``) through
``runuser -u`` (or ``setpriv``), and its directory is owned by that user. pytest's own temporary directories sit
under ``/tmp/pytest-of-root`` (mode 700), which that user cannot enter, so as root the server's
directory is a fresh private one under the system temp dir instead of ``tmp_path``, removed at
the end. The server listens on 127.0.0.1 only (its unix socket in that private directory), and
TCP logins need the random password this module generates (scram-sha-256).

fsync is off: a test database need not survive a power cut, and commits are then ~10x faster.
The server's ``TimeZone`` is deliberately not UTC, so every timestamp the job store reads back
carries a non-zero offset and code that assumes naive UTC values shows up in the tests.
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.ports import free_port
from timing import scaled

SUPERUSER = "meshflow"
TIMEZONE = "America/New_York"  # a zone with an offset; see the module docstring
BINARIES = ("initdb", "pg_ctl", "postgres")
INSTALL_HINT = "Debian's postgresql: apt-get install -y --no-install-recommends postgresql; .ci/run installs it"


def find_bin_dir() -> Path | None:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``: PATH first, then the newest
    ``/usr/lib/postgresql/*/bin``; None when there is none."""
    on_path = shutil.which("pg_ctl")
    candidates = [Path(os.path.realpath(on_path)).parent] if on_path else []
    versions = glob.glob("/usr/lib/postgresql/*/bin")
    candidates += sorted((Path(p) for p in versions), key=lambda p: _version_key(p.parent.name), reverse=True)
    for directory in candidates:
        if all(os.access(directory / name, os.X_OK) for name in BINARIES):
            return directory
    return None


def _version_key(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)) or (0,)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def require_postgres() -> Path:
    """The binaries' directory; skips the test without them (fails under ``CI=true``, where
    ``.ci/run`` installs them)."""
    import pytest

    bin_dir = find_bin_dir()
    if bin_dir is None:
        reason = ("PostgreSQL is missing: no initdb/pg_ctl/postgres on PATH or in /usr/lib/postgresql/*/bin "
                  f"({INSTALL_HINT})")
        if in_ci():
            pytest.fail(reason + "; under CI=true this is an error", pytrace=False)
        pytest.skip(reason)
    return bin_dir


def server_user() -> str | None:
    """The unprivileged account the server runs as when we are root; None when we are not root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise RuntimeError("running as root and neither a 'postgres' nor a 'nobody' account exists to run PostgreSQL")


@dataclass
class PostgresServer:
    """One running server: its binaries, directory, port and superuser password."""

    bin_dir: Path
    root: Path  # data/, the socket and server.log live here
    port: int
    password: str
    user: str | None  # the account it runs as when the tests run as root
    version: str = ""

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    def url(self, database: str = "postgres", driver: str = "postgresql+psycopg") -> str:
        """A SQLAlchemy URL for ``database`` (``driver="postgresql"`` gives a plain libpq URL)."""
        return f"{driver}://{SUPERUSER}:{self.password}@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        command = [str(self.bin_dir / args[0]), *args[1:]]
        if self.user is not None:  # runuser (util-linux), else setpriv from the same package
            account = pwd.getpwnam(self.user)
            command = (["runuser", "-u", self.user, "--", *command] if shutil.which("runuser") else
                       ["setpriv", f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}", "--init-groups", *command])
        env = {**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8", "TZ": "UTC"}
        proc = subprocess.run(command, cwd=self.root, env=env, capture_output=True, text=True, timeout=scaled(timeout))
        if proc.returncode != 0:
            log = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(command)} failed with {proc.returncode}:\n{proc.stdout}{proc.stderr}{log}")
        return proc

    def init_and_start(self) -> "PostgresServer":
        password_file = self.root / "pwfile"
        password_file.write_text(self.password + "\n")
        if self.user is not None:
            account = pwd.getpwnam(self.user)
            for path in (self.root, password_file):
                os.chown(path, account.pw_uid, account.pw_gid)
        self.root.chmod(0o700)
        self._run("initdb", "-D", str(self.data_dir), "-U", SUPERUSER, f"--pwfile={password_file}",
                  "--auth-host=scram-sha-256", "--auth-local=peer", "-E", "UTF8", "--locale=C.UTF-8")
        password_file.unlink()
        options = (f"-h 127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c synchronous_commit=off "
                   f"-c full_page_writes=off -c max_connections=200 -c timezone={TIMEZONE}")
        self._run("pg_ctl", "-D", str(self.data_dir), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start")
        self.version = self._run("postgres", "--version").stdout.strip()
        return self

    def create_database(self, name: str) -> str:
        """``CREATE DATABASE name`` (a new, empty one); its SQLAlchemy URL."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url(driver="postgresql"), autocommit=True) as connection:
            connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def stop(self) -> None:
        """``pg_ctl stop -m fast`` (open connections are cut), then the directory is removed."""
        try:
            if (self.data_dir / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.data_dir), "-m", "fast", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def start_postgres(tmp_dir: Path) -> PostgresServer:
    """Start a private server (see the module docstring); the caller stops it. ``tmp_dir`` holds it
    unless we are root, in which case a fresh directory the server's account can reach is used."""
    bin_dir = find_bin_dir()
    if bin_dir is None:
        raise FileNotFoundError("PostgreSQL's initdb/pg_ctl/postgres are not on PATH nor in /usr/lib/postgresql/*/bin")
    user = server_user()
    if user is None:
        root = Path(tmp_dir) / "postgres"
        root.mkdir(parents=True)
    else:
        root = Path(tempfile.mkdtemp(prefix="meshflow-pg-"))
    server = PostgresServer(bin_dir=bin_dir, root=root, port=free_port(), password=secrets.token_hex(16), user=user)
    try:
        return server.init_and_start()
    except BaseException:
        server.stop()
        raise
