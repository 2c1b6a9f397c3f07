"""The most bytes one HTTP request body may carry (`--max-request-bytes`), enforced before the
body is parsed: vLLM's app reads a body whole and parses it into objects several times its size,
so an unbounded one lets a single client take the gateway's memory.

A declared Content-Length over the limit is answered 413 at once, the body unread; a chunked
body is counted as it arrives and answered 413 the moment it passes the limit (the app, which
was reading it, never sees it whole). Either way the connection closes, as a server that stops
reading a body must.
"""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

# Above one AddRequest's 63 MiB (the gRPC message limit less its envelope): a body the control
# plane could take is never refused here for its size alone.
DEFAULT_MAX_REQUEST_BYTES = 64 << 20


class BodyLimitMiddleware:
    """Pure ASGI, outside vLLM's app: 413 (OpenAI's error shape) for a body over `limit` bytes."""

    def __init__(self, app: Callable, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = content_length(scope)
        if declared is not None and declared > self.limit:
            return await self._refuse(send, f"the request body is {declared} bytes")
        seen = 0
        started = refused = False

        async def counted() -> dict[str, Any]:
            # Past the limit, the 413 goes out here and the app is told the client left: an
            # exception instead would be caught by FastAPI's body parsing and become its 400.
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    refused = True
                    if not started:
                        await self._refuse(send, f"the request body passed {self.limit} bytes")
                    return {"type": "http.disconnect"}
            return message

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            if refused:
                return  # the app's answer to a body it never got whole: the 413 was the answer
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except Exception:
            if not refused:
                raise  # what the app does about the "disconnect" is no fault to report

    async def _refuse(self, send: Send, what: str) -> None:
        message = f"{what}, over this gateway's limit of {self.limit} bytes (--max-request-bytes)"
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses a malformed one before the app runs
    return None
