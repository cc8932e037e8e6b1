"""/v1/jobs/{id}/logs: a job's log whole, its tail, a byte Range, or followed as Server-Sent Events.

Whatever the size of the file, memory stays constant: the file is sent in 64 KiB chunks, the
tail is found by reading backwards block by block, and a Range is served by Starlette's
FileResponse. No database session is held while bytes flow: the job is looked up in a
session of its own, and a followed log asks for the job's state in a fresh one per poll.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Annotated

import anyio
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import FileResponse, PlainTextResponse, StreamingResponse

from api.deps import CurrentUser, PlaneDep
from api.errors import ERROR_RESPONSES, JOB_RESPONSES, QUOTA_RESPONSES
from service.plane import ControlPlane
from service.store import Job, JobState

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=ERROR_RESPONSES)

CHUNK = 1 << 16
TAIL_SCAN_LIMIT = 64 << 20  # a tail never looks further back than this (a file without newlines)
KEEPALIVE_S = 15.0  # an SSE comment this often keeps idle proxies from closing the stream
LOG_CONTENT = {"text/plain": {"schema": {"type": "string"}}, "text/event-stream": {}}


@router.get("/{job_id}/logs",
            responses={200: {"content": LOG_CONTENT, "description": "The log; with follow=true, SSE until "
                                                                    "the job ends."},
                       206: {"content": {"text/plain": {"schema": {"type": "string"}}},
                             "description": "The bytes a `Range: bytes=a-b` header asked for."},
                       **JOB_RESPONSES, **QUOTA_RESPONSES})
def read_job_logs(job_id: str, request: Request, plane: PlaneDep, user: CurrentUser,
                  follow: Annotated[bool, Query(description="Stream new lines as Server-Sent Events until "
                                                            "the job ends.")] = False,
                  tail: Annotated[int | None, Query(ge=1, le=1_000_000, description="Only the last N lines (with "
                                                    "follow: start there).")] = None,
                  ) -> Response:
    """The job's combined stdout and stderr: whole, its last lines, a byte Range, or followed as SSE."""
    with plane.sessions() as session:  # closed before any byte is sent
        path = plane.log_path(plane.get_job(session, job_id, user=user))
    start = _tail_offset(path, tail) if tail else 0
    if follow:
        release = plane.log_streams.acquire(user)  # 429 when the user's streams are all in use
        stream = _follow_log(plane, release, job_id, path, start)
        weakref.finalize(stream, release)  # also when the client left before the stream began
        return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    if not path.is_file():
        return PlainTextResponse("")
    if tail is None and "range" in request.headers:
        return FileResponse(path, media_type="text/plain; charset=utf-8")
    return StreamingResponse(_read_file(path, start, path.stat().st_size), media_type="text/plain; charset=utf-8")


def _tail_offset(path: Path, lines: int) -> int:
    """The byte offset where the last ``lines`` lines of ``path`` begin (a final newline ends a line).

    Blocks are read from the end and their newlines counted by ``bytes.count`` / ``bytes.rsplit``
    (C loops), so the cost is the tail's blocks, whatever the file's size before them."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            position, wanted = end, lines
            while position > 0 and end - position < TAIL_SCAN_LIMIT:
                size = min(CHUNK, position)
                position -= size
                f.seek(position)
                block = f.read(size)
                if position + size == end and block.endswith(b"\n"):
                    block = block[:-1]  # the file's last newline ends the last line; it starts none
                found = block.count(b"\n")
                if found >= wanted:  # the line starts in this block: after its wanted-th newline from the end
                    return position + len(block.rsplit(b"\n", wanted)[0]) + 1
                wanted -= found
            return position
    except FileNotFoundError:
        return 0


def _read_file(path: Path, start: int, stop: int) -> Iterator[bytes]:
    """The bytes ``start:stop`` of ``path`` in chunks (Starlette runs this in a worker thread)."""
    with open(path, "rb") as f:
        f.seek(start)
        while start < stop:
            data = f.read(min(CHUNK, stop - start))
            if not data:
                return
            start += len(data)
            yield data


def _read_from(path: Path, offset: int) -> tuple[str, int]:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(CHUNK)
    except FileNotFoundError:
        return "", offset
    return data.decode(errors="replace"), offset + len(data)


def _state_of(plane: ControlPlane, job_id: str) -> JobState | None:
    with plane.sessions() as session:
        job = session.get(Job, job_id)
        return JobState(job.state) if job else None


async def _follow_log(plane: ControlPlane, release: Callable[[], None], job_id: str, path: Path,
                      offset: int) -> AsyncIterator[str]:
    """SSE lines of the log from ``offset`` until the job ends; gives the user's stream slot back at the end."""
    try:
        partial, finished, last_sent = "", False, time.monotonic()
        while True:
            chunk, offset = await anyio.to_thread.run_sync(_read_from, path, offset)
            if chunk:
                lines = (partial + chunk).replace("\r", "\n").split("\n")
                partial = lines.pop()
                for line in lines:
                    yield f"data: {line}\n\n"
                last_sent = time.monotonic()
                continue
            if time.monotonic() - last_sent > KEEPALIVE_S:
                yield ": keep-alive\n\n"
                last_sent = time.monotonic()
            if finished:
                if partial:
                    yield f"data: {partial}\n\n"
                state = await anyio.to_thread.run_sync(_state_of, plane, job_id)
                yield f"event: end\ndata: {state.value if state else 'DELETED'}\n\n"
                return
            state = await anyio.to_thread.run_sync(_state_of, plane, job_id)
            if state is None or state.is_terminal:
                finished = True  # one more read catches the last bytes written before the end
                continue
            await anyio.sleep(0.25)
    finally:
        release()
