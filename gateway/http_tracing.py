"""The gateway's part of request tracing (ttserve/tracing.py has the whole): one HTTP server span
per API request, the root of everything the request causes downstream.

`TracingMiddleware`, outermost on vLLM's app and installed only with --otlp-traces-endpoint:
- starts `POST /v1/chat/completions` (kind server; renamed to the matched route's template once
  routed), a child of the client's `traceparent`/`tracestate` when they are valid, else a new
  trace, and ends it when the response's last byte is sent (a stream's end), or when the app
  raises;
- rewrites the request's `traceparent` header to the span's own before vLLM reads it. vLLM's
  serving layer copies the raw request's trace headers into `generate(trace_headers=...)`, hence
  into EngineCoreRequest.trace_headers, which the gateway sends to the control plane
  (AddRequest.trace_headers, convert.to_add_request) and sets on the request's finishing
  output (vLLM's own `llm_request` span): everything downstream is the HTTP span's child. A
  client `tracestate` is kept only when the client's trace is continued (W3C: it belongs to
  that trace);
- answers every traced response with W3C Trace Context Level 2's `traceresponse` header
  (`00-<trace id>-<the HTTP span's id>-<flags>`), and appends ` (trace_id <32 hex>)` to the
  message of every OpenAI-shaped error in it: a JSON error body (whoever made it: vLLM, the
  refusals, the key check, the body limit) and a streamed error event (vLLM's chat/completions
  `data: {"error": ...}` and the Responses API's `event: error`). This is the one place error
  messages get their trace id.
Probes (/health, /ready, /metrics, /ping) get no span: they would bury the requests.

Span status: error for a 5xx, an exception, or an error event in a streamed 200; a 4xx is the
client's and leaves it unset (OpenTelemetry's HTTP server convention).
"""
from __future__ import annotations

import contextvars
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from ttserve.tracing import TRACE_HEADERS, Span, Tracer, TracingUnavailable, require

log = logging.getLogger("ttserve.gateway.tracing")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

SERVICE_NAME = "ttserve-gateway"
# What vLLM's tracing imports (vllm/tracing/otel.py, vLLM 0.32.0): without any of them vLLM
# refuses --otlp-traces-endpoint in its config validation with a traceback; checked first so
# the gateway refuses with the fix instead.
VLLM_OTEL_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
                     "opentelemetry.exporter.otlp.proto.http.trace_exporter")
PROBES = frozenset({"/health", "/ready", "/metrics", "/ping"})
TRACERESPONSE = b"traceresponse"
# An error body larger than this passes unchanged (error bodies are a few hundred bytes; the
# bound keeps a pathological one from being held in memory).
MAX_ERROR_BODY = 1 << 20


def prepare(endpoint: str | None) -> None:
    """Before vLLM's AsyncLLM is built, with the --otlp-traces-endpoint it will get: raises
    TracingUnavailable without the OpenTelemetry packages vLLM needs, and names the service
    (vLLM's TracerProvider takes service.name from OTEL_SERVICE_NAME; one set outside wins)."""
    if not endpoint:
        return
    require(VLLM_OTEL_MODULES)
    os.environ.setdefault("OTEL_SERVICE_NAME", SERVICE_NAME)


def gateway_tracer(endpoint: str | None) -> Tracer:
    """The gateway's tracer, recording through the process-global TracerProvider that vLLM's
    AsyncLLM set up for `endpoint` (vllm.tracing.init_tracer): one provider, one exporter, for
    vLLM's spans and the gateway's. Off without an endpoint."""
    if not endpoint:
        return Tracer.off()
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    if not hasattr(provider, "add_span_processor"):  # a proxy: nobody set an SDK provider
        raise TracingUnavailable("vLLM did not set up an OpenTelemetry TracerProvider for "
                                 f"--otlp-traces-endpoint {endpoint}")
    return Tracer.otlp(endpoint, "gateway", provider=provider)


# ---- the HTTP request a coroutine serves ---------------------------------------------------------

@dataclass(slots=True)
class _Served:
    """The traced HTTP request being served in this context: its span, its method, the scope the
    app routes (where the router leaves the matched route), and the ids vLLM gave the engine
    requests it made."""
    span: Span
    method: str
    scope: Scope
    external_ids: list[str] = field(default_factory=list)
    internal_ids: list[str] = field(default_factory=list)

    def describe(self) -> None:
        """What the span learned while the request was served; just before it ends."""
        route = getattr(self.scope.get("route"), "path", None)
        # OpenTelemetry's HTTP naming: the route's template, or the method alone when no route
        # matched (a 404 for each path a client makes up would otherwise make a name each).
        self.span.rename(f"{self.method} {route}" if route else self.method)
        self.span.set({"http.route": route, "gen_ai.request.id": _one_or_all(self.external_ids),
                       "ttserve.request_id": _one_or_all(self.internal_ids)})


def _one_or_all(ids: list[str]) -> str | list[str] | None:
    return None if not ids else ids[0] if len(ids) == 1 else list(ids)


# Set by the middleware for the request it serves; vLLM's serving layer, and the engine client
# under it, run in that context (tasks they spawn copy it). None: not traced.
_served: contextvars.ContextVar[_Served | None] = contextvars.ContextVar("ttserve_gateway_http_span",
                                                                         default=None)


def note_request(request: Any) -> None:
    """For an EngineCoreRequest the engine client is sending: its ids go on the HTTP span, and a
    request whose serving path passed no trace headers gets the HTTP span's (so its control-plane
    spans still join the trace). Untraced: nothing (one context variable read)."""
    served = _served.get()
    if served is None:
        return
    external = getattr(request, "external_req_id", None) or request.request_id
    if external not in served.external_ids:
        served.external_ids.append(external)
    served.internal_ids.append(request.request_id)
    if not request.trace_headers:
        request.trace_headers = served.span.headers()


# ---- the middleware ------------------------------------------------------------------------------

class TracingMiddleware:
    """Pure ASGI, outermost: the HTTP server span of each request but probes (module docstring)."""

    def __init__(self, app: Callable, tracer: Tracer) -> None:
        assert tracer.enabled, "installed only when tracing is on"
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBES:
            return await self.app(scope, receive, send)
        method, path = scope.get("method", "GET"), scope["path"]
        client = client_trace_headers(scope.get("headers") or ())
        span = self.tracer.start(f"{method} {path}", client or None, kind="server", attributes={
            "http.request.method": method, "url.path": path, "url.scheme": scope.get("scheme"),
            "network.protocol.version": scope.get("http_version")})
        # The client's trace is continued exactly when the span took its trace id (a new one is
        # random); its tracestate belongs to that trace only.
        continued = bool(client) and span.trace_id in client["traceparent"]
        inner = dict(scope, headers=rewritten_headers(scope.get("headers") or (), span.traceparent, continued))
        served = _Served(span, method, inner)
        response = _Response(served, send)
        token = _served.set(served)
        error: str | None = None
        try:
            await self.app(inner, receive, response.send)
        except Exception as e:  # a cancellation (the client left) is no server error: `finally` ends the span
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            _served.reset(token)
            response.finish(error)


class _Response:
    """The response side of one traced request: adds `traceresponse`, puts the trace id in error
    messages, and ends the span after the last byte."""

    def __init__(self, served: _Served, send: Send) -> None:
        self.served = served
        self.span = span = served.span
        self._send = send
        self.status: int | None = None
        self.error: str | None = None  # an error event in a stream
        self._suffix = f" (trace_id {span.trace_id})"
        self._held: dict[str, Any] | None = None  # an error response's start, until its body is whole
        self._body: list[bytes] = []
        self._stream = False
        self._ended = False

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = int(message["status"])
            headers = [*message.get("headers", ()), (TRACERESPONSE, self.span.traceparent.encode())]
            message = {**message, "headers": headers}
            content_type = _content_type(headers)
            self._stream = content_type == b"text/event-stream"
            if self.status >= 400 and content_type == b"application/json":
                self._held = message
                return
            await self._send(message)
            return
        if kind != "http.response.body":
            await self._send(message)
            return
        last = not message.get("more_body", False)
        if self._held is not None:
            self._body.append(message.get("body", b""))
            size = sum(map(len, self._body))
            if not last and size <= MAX_ERROR_BODY:
                return
            await self._release(whole=last)
            if not last:
                return
        elif self._stream and b'"error"' in (chunk := message.get("body", b"")):
            rewritten, self.error = with_trace_id_in_events(chunk, self._suffix, self.error)
            if rewritten is not chunk:
                message = {**message, "body": rewritten}
            await self._send(message)
        else:
            await self._send(message)
        if last:
            self.finish(None)

    async def _release(self, whole: bool) -> None:
        """Sends the held error response: its message with the trace id when the body is whole."""
        held, body = self._held, b"".join(self._body)
        assert held is not None
        self._held, self._body = None, []
        rewritten = with_trace_id(body, self._suffix) if whole else None
        if rewritten is not None:
            body = rewritten
            held = {**held, "headers": [(k, str(len(body)).encode()) if k.lower() == b"content-length" else (k, v)
                                        for k, v in held["headers"]]}
        await self._send(held)
        await self._send({"type": "http.response.body", "body": body, "more_body": not whole})

    def finish(self, error: str | None) -> None:
        """Ends the span, once: after the last byte, or when the app returns or raises."""
        if self._ended:
            return
        self._ended = True
        self.served.describe()
        if self.status is not None:
            self.span.set({"http.response.status_code": self.status})
        if error is None and self.status is not None and self.status >= 500:
            error = f"HTTP {self.status}"
        self.span.end(error=error or self.error)


# ---- headers and messages ------------------------------------------------------------------------

def client_trace_headers(headers: Any) -> dict[str, str]:
    """The client's `traceparent` and `tracestate` (ASGI headers: lower-case byte names). A
    repeated traceparent is no context at all (W3C: the request's context is then invalid)."""
    found: dict[str, list[str]] = {}
    for name, value in headers:
        key = name.decode("latin-1").lower()
        if key in TRACE_HEADERS:
            found.setdefault(key, []).append(value.decode("latin-1"))
    if len(found.get("traceparent", ())) != 1:
        return {}
    # Repeated tracestate headers are one list (RFC 9110 field combination).
    return {key: ",".join(values) for key, values in found.items()}


def rewritten_headers(headers: Any, traceparent: str, keep_tracestate: bool) -> list[tuple[bytes, bytes]]:
    """The request's headers as the app sees them: `traceparent` naming the HTTP span, the
    client's tracestate only when its trace is continued."""
    out = [(name, value) for name, value in headers
           if name.lower() != b"traceparent" and (keep_tracestate or name.lower() != b"tracestate")]
    out.append((b"traceparent", traceparent.encode()))
    return out


def with_trace_id(body: bytes, suffix: str) -> bytes | None:
    """An OpenAI error body (`{"error": {"message": ...}}`) with `suffix` after its message; None
    for a body of another shape."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    if not _add_suffix(document, suffix):
        return None
    return json.dumps(document).encode()


def with_trace_id_in_events(chunk: bytes, suffix: str, error: str | None) -> tuple[bytes, str | None]:
    """A streamed chunk (SSE) with `suffix` after the message of each error event in it, and the
    first error message seen (for the span's status); the chunk itself when it holds none."""
    lines = chunk.split(b"\n")
    changed = False
    for i, line in enumerate(lines):
        if not line.startswith(b"data: ") or b'"error"' not in line:
            continue
        try:
            document = json.loads(line[len(b"data: "):])
        except ValueError:
            continue
        message = _add_suffix(document, suffix)
        if message is not None:
            error = error or message
            lines[i] = b"data: " + json.dumps(document).encode()
            changed = True
    return (b"\n".join(lines) if changed else chunk), error


def _add_suffix(document: Any, suffix: str) -> str | None:
    """Appends `suffix` to the message of an OpenAI error (`{"error": {"message"}}`, or the
    Responses API's `{"type": "error", "message"}`) in place; its message before, or None."""
    if not isinstance(document, dict):
        return None
    holder = document.get("error") if isinstance(document.get("error"), dict) else \
        document if document.get("type") == "error" else None
    if holder is None or not isinstance(holder.get("message"), str):
        return None
    message = holder["message"]
    if not message.endswith(suffix):
        holder["message"] = message + suffix
    return message


def _content_type(headers: Any) -> bytes | None:
    for name, value in headers:
        if name.lower() == b"content-type":
            return value.split(b";")[0].strip().lower()
    return None

