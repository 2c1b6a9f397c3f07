"""OpenTelemetry tracing, shared by the three services: one trace per request, W3C trace context
(`traceparent`) carried from the HTTP client through the gateway, the control plane (in the
request, engine.proto AddRequest.trace_headers) and the worker (in each traced step item,
device.proto `traceparent`).

Off (no --otlp-traces-endpoint) a service holds `Tracer.off()`: `enabled` is False and callers
test it before building anything, so an untraced request or step costs one attribute read. The
OpenTelemetry SDK is an optional extra (`pip install 'ttserve[tracing]'`); asking for traces
without it is refused at start-up with that fix.

Spans here are recorded with explicit wall-clock times (`start_ns`, `end_ns`): the control plane
and the worker learn an interval once it is over (a prefill chunk when its step lands, a
request's queue time once it is scheduled), as vLLM's own `llm_request` span is made.
Export is OTLP over gRPC (default) or HTTP/protobuf, as vLLM chooses it
(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL), batched off the serving thread (BatchSpanProcessor).
"""
from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

# W3C Trace Context: version 00, 32 hex trace id, 16 hex parent id, 2 hex flags.
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
TRACE_HEADERS = ("traceparent", "tracestate")  # what is carried from service to service


class TracingUnavailable(RuntimeError):
    """--otlp-traces-endpoint was given and the OpenTelemetry SDK is not installed."""

    @classmethod
    def missing(cls, module: str) -> TracingUnavailable:
        return cls(f"--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporter ({module} is "
                   "missing): pip install 'ttserve[tracing]'")


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id a W3C traceparent names, None for a missing or malformed one."""
    match = TRACEPARENT.match(traceparent or "")
    return match.group(1) if match and match.group(1) != "0" * 32 else None


def trace_headers(headers: Mapping[str, str] | Any) -> dict[str, str]:
    """The trace context headers of an HTTP or gRPC header mapping (lower-cased names)."""
    found = {}
    for name in TRACE_HEADERS:
        value = headers.get(name) if hasattr(headers, "get") else None
        if value:
            found[name] = value
    return found


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as wall-clock nanoseconds (span times are wall clock)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class Span:
    """A recorded span's identity, for children and for log lines."""

    __slots__ = ("_span",)

    def __init__(self, span: Any) -> None:
        self._span = span

    @property
    def trace_id(self) -> str:
        return format(self._span.get_span_context().trace_id, "032x")

    @property
    def traceparent(self) -> str:
        context = self._span.get_span_context()
        return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"

    def headers(self) -> dict[str, str]:
        """Trace headers that make a receiver's spans children of this one."""
        return {"traceparent": self.traceparent}

    def event(self, name: str, attributes: Mapping[str, Any] | None = None, at_ns: int | None = None) -> None:
        self._span.add_event(name, dict(attributes or {}), timestamp=at_ns)

    def rename(self, name: str) -> None:
        """A span whose proper name is known only later (an HTTP server span, once routed)."""
        self._span.update_name(name)

    def set(self, attributes: Mapping[str, Any]) -> None:
        self._span.set_attributes({k: v for k, v in attributes.items() if v is not None})

    def end(self, end_ns: int | None = None, error: str | None = None) -> None:
        if error:
            from opentelemetry.trace import Status, StatusCode
            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end(end_time=end_ns)


class Tracer:
    """One service's tracer: `Tracer.off()`, or `Tracer.otlp(...)` exporting to a collector."""

    def __init__(self, provider: Any = None, service: str = "") -> None:
        self.enabled = provider is not None
        self.service = service
        self._provider = provider
        self._tracer = provider.get_tracer(f"ttserve.{service}") if provider is not None else None
        self._propagator = None
        if provider is not None:
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
            self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def off(cls) -> Tracer:
        return cls()

    @classmethod
    def otlp(cls, endpoint: str | None, service: str, attributes: Mapping[str, str] | None = None,
             provider: Any = None) -> Tracer:
        """A tracer exporting to the OTLP collector at `endpoint` as service `ttserve-<service>`
        (OTEL_SERVICE_NAME wins), or off when `endpoint` is None or empty. `provider`: an
        existing TracerProvider to record through (the gateway's, which vLLM's frontend set up)."""
        if not endpoint:
            return cls.off()
        if provider is None:
            provider = _provider(endpoint, service, attributes or {})
        return cls(provider, service)

    def start(self, name: str, parent: Mapping[str, str] | str | Span | None = None, *,
              start_ns: int | None = None, kind: str = "internal",
              attributes: Mapping[str, Any] | None = None,
              links: Sequence[Mapping[str, str] | str] = ()) -> Span:
        """Starts a span, a child of `parent` (trace headers, a traceparent, or a Span; None: a
        new trace), linked to `links` (other traceparents: a step that serves several traces)."""
        assert self._tracer is not None, "start() on a tracer that is off: test `enabled` first"
        from opentelemetry.trace import Link, SpanKind, get_current_span
        context = self._context(parent)
        span_links = []
        for link in links:
            linked = get_current_span(self._context(link)).get_span_context()
            if linked.is_valid:
                span_links.append(Link(linked))
        span = self._tracer.start_span(
            name, context=context, kind=getattr(SpanKind, kind.upper()), start_time=start_ns,
            attributes={k: v for k, v in (attributes or {}).items() if v is not None}, links=span_links)
        return Span(span)

    def record(self, name: str, parent: Mapping[str, str] | str | Span | None, start_ns: int, end_ns: int,
               attributes: Mapping[str, Any] | None = None, links: Sequence[Mapping[str, str] | str] = (),
               kind: str = "internal") -> Span:
        """A span whose interval is already over."""
        span = self.start(name, parent, start_ns=start_ns, attributes=attributes, links=links, kind=kind)
        span.end(end_ns)
        return span

    def _context(self, parent: Mapping[str, str] | str | Span | None) -> Any:
        if parent is None:
            return None
        if isinstance(parent, Span):
            from opentelemetry.trace import set_span_in_context
            return set_span_in_context(parent._span)
        carrier = {"traceparent": parent} if isinstance(parent, str) else dict(parent)
        return self._propagator.extract(carrier)

    def shutdown(self) -> None:
        """Exports what is batched (a service's last requests) and stops the exporter."""
        if self._provider is not None and hasattr(self._provider, "shutdown"):
            self._provider.shutdown()


def require(modules: Sequence[str]) -> None:
    """Raises TracingUnavailable, naming the first of `modules` that does not import, with the
    fix: for a service whose TracerProvider a library builds (the gateway's: vLLM's), checked
    before that library refuses in its own words."""
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise TracingUnavailable.missing(e.name or module) from None


def _provider(endpoint: str, service: str, attributes: Mapping[str, str]) -> Any:
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise TracingUnavailable.missing(e.name) from None
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or f"ttserve-{service}",
                                "process.pid": os.getpid(), **attributes})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(span_exporter(endpoint)))
    return provider


def span_exporter(endpoint: str) -> Any:
    """vLLM's choice of exporter (vllm/tracing/otel.py get_span_exporter, vllm 0.32.0): OTLP over
    gRPC unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL says http/protobuf."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            return OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
            return HttpExporter(endpoint=endpoint)
    except ImportError as e:
        raise TracingUnavailable.missing(e.name) from None
    raise TracingUnavailable(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r} is not supported: use grpc or "
                             "http/protobuf")


def add_arguments(group: Any, detailed: bool = False) -> None:
    """The tracing flags, as vLLM spells them (its ObservabilityConfig)."""
    group.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="send OpenTelemetry traces to this OTLP collector (gRPC, e.g. "
                            "http://collector:4317; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf for "
                            "OTLP/HTTP); needs pip install 'ttserve[tracing]'")
    if detailed:
        group.add_argument("--collect-detailed-traces", default=None, metavar="MODULES",
                           help="with --otlp-traces-endpoint: also trace worker steps (all, model or "
                                "worker, comma-separated, as vLLM): each prefill step and one decode step "
                                "in 16 per request carries its trace to the worker")


def detailed_modules(value: str | None) -> frozenset[str]:
    """--collect-detailed-traces parsed: a subset of {all, model, worker}; ValueError names the bad one."""
    if not value:
        return frozenset()
    modules = frozenset(m.strip() for m in value.split(",") if m.strip())
    unknown = modules - {"all", "model", "worker"}
    if unknown:
        raise ValueError(f"--collect-detailed-traces takes all, model or worker (comma-separated), got "
                         f"{', '.join(sorted(unknown))}")
    return modules
