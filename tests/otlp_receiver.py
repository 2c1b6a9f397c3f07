"""An OTLP trace receiver on loopback: the OpenTelemetry collector's gRPC protocol
(opentelemetry.proto.collector.trace.v1.TraceService/Export), as a collector or Jaeger serves it
on 4317. The services under test export to it over the network as they would to a real
collector; it keeps every span it is sent, with its resource's service.name."""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from stack import free_port


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str   # "" for a root
    attributes: dict
    links: tuple[str, ...]  # linked span ids
    start_ns: int
    end_ns: int


def _value(v) -> object:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class _Service(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: "OtlpReceiver") -> None:
        self.sink = sink

    def Export(self, request, context):
        spans = []
        for resource_spans in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    spans.append(ReceivedSpan(
                        service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        {a.key: _value(a.value) for a in s.attributes},
                        tuple(link.span_id.hex() for link in s.links), s.start_time_unix_nano, s.end_time_unix_nano))
        with self.sink.lock:
            self.sink.spans.extend(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Service(self), self._server)
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        self._server.start()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, services: set[str], timeout_s: float = 30.0,
                 names: set[str] = frozenset()) -> list[ReceivedSpan]:
        """The trace's spans once every service in `services` and every span name in `names`
        has sent some (the services batch their exports)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            if services <= {s.service for s in spans} and names <= {s.name for s in spans}:
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"trace {trace_id}: after {timeout_s:g} s, spans from "
                                     f"{sorted({(s.service, s.name) for s in spans})}; wanted services "
                                     f"{sorted(services)} and names {sorted(names)}")
            time.sleep(0.2)

    def stop(self) -> None:
        self._server.stop(grace=None)
