"""Pure-ASGI request-body limits, before any handler (or JSON parser) reads the body: a body over
the size limit gets 413, a body nested deeper than the depth limit gets 422."""

from __future__ import annotations

import json
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimit:
    """Refuse bodies over ``max_bytes`` with 413, by Content-Length or, without one, while reading."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_bytes
            except ValueError:
                too_big = True
            if too_big:
                await self._refuse(send)
                return
            await self.app(scope, receive, send)
            return
        # No Content-Length (chunked): buffer up to the limit, then replay what was read.
        messages: list[Message] = []
        size, more = 0, True
        while more:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(send)
                return
            more = message.get("more_body", False)

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"detail": f"request body over {self.max_bytes} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(body: bytes, stop_above: int) -> int:
    """How deeply ``body``'s arrays and objects nest (strings skipped); counting stops past ``stop_above``."""
    depth = deepest = 0
    for byte in _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS):
        depth += 1 if byte in b"[{" else -1
        if depth > deepest:
            deepest = depth
            if deepest > stop_above:
                break
    return deepest


class JsonDepthLimit:
    """Refuse bodies nested deeper than ``max_depth`` with a 422 naming the limit: Python's JSON
    parser and everything after it recurse, and a thousand levels end in a RecursionError (a 500).

    Every body is measured, whatever its ``Content-Type``: FastAPI parses a body as JSON also
    without that header, and media types are case-insensitive (``application/JSON`` is JSON), so
    a check that trusted the header let deep bodies through. A body that is not JSON at all has no
    brackets to count (and no endpoint takes one)."""

    def __init__(self, app: ASGIApp, *, max_depth: int) -> None:
        self.app = app
        self.max_depth = max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        body, more = b"", True
        while more:  # the size limit (outside this middleware) bounds what is buffered here
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if (depth := json_depth(body, self.max_depth)) > self.max_depth:
            problem = {"path": "<body>", "reason": f"JSON nested more than {self.max_depth} levels deep (at least "
                       f"{depth}); the limit is {self.max_depth} (max_json_depth)",
                       "fix": "send a flatter document: a config is a few levels deep"}
            payload = json.dumps({"detail": [problem]}).encode()
            await send({"type": "http.response.start", "status": 422,
                        "headers": [(b"content-type", b"application/json"), (b"content-length",
                                                                             str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
