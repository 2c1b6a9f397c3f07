"""How the control plane's refusals reach HTTP clients.

A refusal is raised from `add_request_async` as an exception type that vLLM's serving layer
already maps to a status: `RequestRefused` is a VLLMValidationError (400), `ControlPlaneUnavailable`
and `GatewayShuttingDown` (this gateway drains) GracefulHTTPErrors carrying 503. For non-streamed
requests that is the whole story.

A streamed response has sent "200 OK" before its generator runs, so vLLM reports an error raised
there as an SSE event inside a 200. The control plane's verdict arrives exactly there (after
`generate()` starts), so `RefusalStatusMiddleware` holds a POST response's start until its first
body chunk; if a refusal was recorded for this HTTP request by then, the client gets the refusal
as a plain JSON error with its real status instead of the stream. (The cost: a streamed
response's headers leave with its first chunk, i.e. at the first token, as for a non-streamed
one.) A refusal after the first chunk (n>1 is fanned out before any output, so none) would
still arrive as vLLM's SSE error event.
"""
from __future__ import annotations

import contextvars
import json
import logging
from http import HTTPStatus
from typing import Any, Awaitable, Callable

from ttserve.gateway import vllm_compat

vllm_compat.prepare()

from vllm.exceptions import GracefulHTTPError, VLLMValidationError  # noqa: E402

from ttserve.gateway.metrics import REFUSED  # noqa: E402


class RequestRefused(VLLMValidationError):
    """The control plane (or this gateway) refused the request as invalid: HTTP 400."""


class ControlPlaneUnavailable(GracefulHTTPError):
    """The control plane cannot take requests now (unreachable, no ready worker): HTTP 503."""

    def __init__(self, message: str) -> None:
        super().__init__(message, HTTPStatus.SERVICE_UNAVAILABLE)


class ControlPlaneOverloaded(ControlPlaneUnavailable):
    """Too many requests wait at the control plane (--max-num-queued-reqs): HTTP 503, retry later."""


class GatewayShuttingDown(GracefulHTTPError):
    """This gateway is draining (SIGTERM arrived) and admits no new request: HTTP 503."""

    MESSAGE = ("the gateway is shutting down and admits no new requests; "
               "retry on another instance")

    def __init__(self, message: str = MESSAGE) -> None:
        super().__init__(message, HTTPStatus.SERVICE_UNAVAILABLE)


REFUSALS = (RequestRefused, ControlPlaneUnavailable, GatewayShuttingDown)

# Seconds a client is told to wait before retrying a 503 (Retry-After): an overload or a worker
# coming back lasts seconds, not minutes.
RETRY_AFTER_S = 1


def refusal_status(error: Exception) -> str:
    """The `status` label of ttserve_gateway_refused_requests_total for a refusal."""
    return "503" if isinstance(error, GracefulHTTPError) else "400"


# The refusals recorded while serving the current HTTP request; set by the middleware. Tasks
# spawned for the request copy the context, so they all see (and append to) the same list. A
# context variable because vLLM's serving layer stands between the engine client that refuses
# and the middleware: the refusal reaches the middleware otherwise only as an SSE error event.
_refusals: contextvars.ContextVar[list[Exception] | None] = contextvars.ContextVar(
    "ttserve_gateway_refusals", default=None)


def record_refusal(error: Exception, n: int = 1) -> None:
    """Count `n` requests refused with `error` and record it for the HTTP request being served
    (RefusalStatusMiddleware)."""
    REFUSED.labels(status=refusal_status(error)).inc(n)
    refusals = _refusals.get()
    if refusals is not None:
        refusals.append(error)


def _error_response(error: Exception) -> tuple[int, bytes]:
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    response = create_error_response(error)
    return response.error.code, json.dumps(response.model_dump()).encode()


class RefusalLogFilter(logging.Filter):
    """vLLM logs an exception raised inside a streamed response with its traceback at ERROR;
    for a refusal (an expected outcome, not a gateway fault) one INFO line is enough."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, REFUSALS):
            record.msg = f"{record.getMessage()}: {type(error).__name__}: {error}"
            record.args = ()
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def quiet_refusal_tracebacks() -> None:
    """Install RefusalLogFilter on the handlers that vLLM's loggers reach."""
    for logger in (logging.getLogger("vllm"), logging.getLogger()):
        for handler in logger.handlers:
            if not any(isinstance(f, RefusalLogFilter) for f in handler.filters):
                handler.addFilter(RefusalLogFilter())


ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]


class RefusalStatusMiddleware:
    """Turns a refusal recorded before a streamed response's first chunk into an HTTP error, and
    tells a client refused with 503 when to retry (Retry-After)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        refusals: list[Exception] = []
        token = _refusals.set(refusals)
        held: dict[str, Any] | None = None
        decided = replaced = False

        async def send_checked(message: dict[str, Any]) -> None:
            nonlocal held, decided, replaced
            if replaced:
                return  # the rest of a stream we already answered with an error
            if decided:
                await send(message)
            elif message["type"] == "http.response.start":
                held = message
            elif message["type"] == "http.response.body" and held is not None:
                decided = True
                if refusals and _is_event_stream(held):
                    replaced = True
                    status, body = _error_response(refusals[0])
                    await send({"type": "http.response.start", "status": status,
                                "headers": _with_retry_after(status, [(b"content-type", b"application/json"),
                                                                      (b"content-length", str(len(body)).encode())])})
                    await send({"type": "http.response.body", "body": body})
                    return
                if refusals:
                    held = {**held, "headers": _with_retry_after(held["status"], list(held.get("headers", ())))}
                await send(held)
                await send(message)
            else:
                await send(message)

        try:
            await self.app(scope, receive, send_checked)
        finally:
            _refusals.reset(token)


def _with_retry_after(status: int, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    if status == HTTPStatus.SERVICE_UNAVAILABLE:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    return headers


def _is_event_stream(start: dict[str, Any]) -> bool:
    for name, value in start.get("headers", ()):
        if name.lower() == b"content-type":
            return value.split(b";")[0].strip() == b"text/event-stream"
    return False
