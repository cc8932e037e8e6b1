"""One MLflow client per job: worker rank 0 hands its writes to the launcher, whose tracker makes them.

The launcher owns the job's MLflow run and has its client loaded; a rank 0 that opened a second client
would import MLflow and its store (about 2 CPU-seconds, in the workers' fork server or in rank 0)
on the few cores that start the workers. Instead the launcher serves its tracker on a local socket
(:class:`RelayServer`, a thread) and rank 0 logs through a :class:`RelayTracker`, which sends each call
there (``multiprocessing.connection``: pickled calls on a Unix socket, the peer checked by a key).

    with RelayServer(tracker) as relay:               # the launcher, around the workers' launch
        launch_workers(..., relay=relay.address)
    tracker = RelayTracker(relay_address)            # worker rank 0
    tracker.log_metrics({"loss": 2.3}, step=1)       # sent; not waited for
    tracker.log_artifact("model.safetensors")        # waited for: the file may be deleted once it returns
    tracker.close()                                  # every write made (or its error raised here)

Writes that name a file are acknowledged before rank 0 goes on; the others are not waited for, and a
write that failed is raised at rank 0's next call (or at :meth:`RelayTracker.close`), as the error the
launcher's tracker raised. A restarted attempt's rank 0 connects again: the steps an earlier attempt
logged of a metric are not logged twice (MLflow would draw each twice), as a tracker attached to a run
with history skips them.
"""

from __future__ import annotations

import os
import pickle
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any

from trainer.tracking.tracker import RunStatus, Tracker, TrackingError

# what rank 0 may call on the launcher's tracker; ``finish`` is the launcher's alone
WRITES = frozenset({"log_params", "log_metrics", "log_summary", "log_artifact_text", "log_artifact", "set_tag",
                    "set_tags", "log_dataset"})
_ACKED = frozenset({"log_artifact", "flush"})  # rank 0 waits: the file it names may go once the call returns
_POLL_S = 0.2  # how often the relay's thread looks whether the launcher stopped it


@dataclass(frozen=True)
class RelayAddress:
    """Where rank 0 reaches the launcher's tracker: the socket and its key (hex)."""

    path: str
    key: str


class RelayServer:
    """The launcher's tracker, served to worker rank 0 on a Unix socket in a private temporary folder, one
    connection at a time (one rank 0 per attempt), by a daemon thread, from entry to exit. (A socket of its
    own rather than ``multiprocessing``'s ``Listener``: its ``accept`` cannot be given up on at exit.)"""

    def __init__(self, tracker: Tracker) -> None:
        self._tracker = tracker
        self._folder = tempfile.TemporaryDirectory(prefix="meshflow-relay-")  # only this user may enter
        self._key = secrets.token_bytes(16)
        path = os.path.join(self._folder.name, "tracker.sock")
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.bind(path)
        self._socket.listen()
        self._socket.settimeout(_POLL_S)
        self.address = RelayAddress(path, self._key.hex())
        self._logged: dict[str, int] = {}  # each metric's last step written through the relay
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="meshflow-tracking-relay", daemon=True)

    def __enter__(self) -> RelayServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop once what rank 0 sent is written (its process has ended: the workers have)."""
        self._stop.set()
        self._thread.join()
        self._socket.close()
        self._folder.cleanup()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                peer, _ = self._socket.accept()
            except TimeoutError:
                continue
            peer.setblocking(True)
            conn = Connection(peer.detach())
            try:
                deliver_challenge(conn, self._key)
                answer_challenge(conn, self._key)
            except Exception:  # noqa: BLE001 - a peer without the key, or one gone before its greeting
                conn.close()
                continue
            with conn:
                self._serve_attempt(conn)

    def _serve_attempt(self, conn: Connection) -> None:
        """One attempt's rank 0, until it disconnects, or the launcher stops the relay and nothing is left to read."""
        floor = dict(self._logged)  # what earlier attempts logged: a restarted one replays its steps
        while True:
            if not conn.poll(_POLL_S):
                if self._stop.is_set():
                    return
                continue
            try:
                seq, method, args, kwargs = conn.recv()
            except Exception:  # noqa: BLE001 - rank 0 gone (EOF, a reset), or a message cut short
                return
            reply: tuple[str, int, Exception | None] | None
            try:
                self._call(method, args, kwargs, floor)
                reply = ("ok", seq, None) if method in _ACKED else None
            except Exception as err:  # noqa: BLE001 - rank 0 raises it, at its next call
                reply = ("error", seq, _portable(err))
            if reply is not None:
                try:
                    conn.send(reply)
                except OSError:  # rank 0 is gone
                    return

    def _call(self, method: str, args: tuple, kwargs: dict, floor: Mapping[str, int]) -> None:
        if method == "flush":
            return
        if method not in WRITES:
            raise TrackingError(f"the tracking relay takes {', '.join(sorted(WRITES))}, not {method!r}")
        if method == "log_metrics":
            metrics, step = args
            metrics = {key: value for key, value in metrics.items() if step > floor.get(key, -1)}
            if not metrics:
                return
            args = (metrics, step)
            for key in metrics:
                self._logged[key] = max(step, self._logged.get(key, -1))
        getattr(self._tracker, method)(*args, **kwargs)


def _portable(err: Exception) -> Exception:
    """``err`` if it survives pickling (rank 0 raises the launcher's error as it is), else its text."""
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001 - an exception type that does not pickle (its own __init__ arguments)
        return TrackingError(f"{type(err).__name__}: {err}")
    return err


class RelayTracker:
    """Worker rank 0's tracker: each call made by the launcher's (:class:`RelayServer`); never imports MLflow.
    Its ``run_id`` is None: the run is the launcher's (which may still be making it)."""

    run_id: str | None = None

    def __init__(self, address: RelayAddress) -> None:
        self._conn = Client(address.path, family="AF_UNIX", authkey=bytes.fromhex(address.key))
        self._lock = threading.Lock()  # one call at a time on the connection (a saving thread may log too)
        self._sent = 0  # calls sent; the launcher answers an acknowledged one with its number

    def _send(self, method: str, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            self._raise_failed()
            self._sent += 1
            self._conn.send((self._sent, method, args, kwargs))
            if method not in _ACKED:
                return
            failed = None  # an earlier write's error comes before this call's answer
            while True:
                status, seq, err = self._conn.recv()
                failed = failed or (err if status == "error" else None)
                if seq == self._sent:
                    break
            if failed is not None:
                raise _from_launcher(failed, method)

    def _raise_failed(self) -> None:
        """An earlier write's error, if the launcher has sent one."""
        if self._conn.poll():  # only errors come unasked
            _, _, err = self._conn.recv()
            raise _from_launcher(err, "an earlier write")

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._send("log_params", dict(params))

    def log_metrics(self, metrics: Mapping[str, float], step: int, *, at_ms: int | None = None) -> None:
        # stamped here: the launcher may write it later (its run still being made), and the charts' time is the step's
        self._send("log_metrics", {key: float(value) for key, value in metrics.items()}, step,
                   at_ms=at_ms if at_ms is not None else int(time.time() * 1000))

    def log_summary(self, values: Mapping[str, float]) -> None:
        self._send("log_summary", dict(values))

    def log_artifact_text(self, text: str, name: str) -> None:
        self._send("log_artifact_text", text, name)

    def log_artifact(self, path: str | Path, artifact_dir: str | None = None) -> None:
        self._send("log_artifact", str(Path(path).resolve()), artifact_dir)

    def set_tag(self, key: str, value: Any) -> None:
        self._send("set_tag", key, str(value))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self._send("set_tags", {key: str(value) for key, value in tags.items()})

    def log_dataset(self, name: str, source: str | None, digest: str, context: str = "training") -> None:
        self._send("log_dataset", name, source, digest, context)

    def finish(self, status: RunStatus) -> None:
        """Nothing: the launcher ends the run it made."""

    def close(self) -> None:
        """Wait until the launcher made every write sent (raising the first that failed), then disconnect."""
        try:
            self._send("flush")
        finally:
            self._conn.close()

    def __repr__(self) -> str:
        return f"RelayTracker({self._conn!r})"


def _from_launcher(err: Exception, what: str) -> Exception:
    err.add_note(f"(raised by the launcher's MLflow client, for rank 0's {what})")
    return err
