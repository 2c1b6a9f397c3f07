"""The gateway's part of request tracing (gateway/http_tracing.py), without a control plane: the
HTTP server span on tiny ASGI apps with an in-memory span exporter, the traceparent rewrite, the
traceresponse header and the trace id in error messages, the trace headers carried into
AddRequest and onto vLLM's llm_request span, and the start-up checks."""
from __future__ import annotations

import asyncio
import json
import sys

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from ttserve.gateway import convert, http_tracing
from ttserve.gateway.http_tracing import TracingMiddleware
from ttserve.tracing import Tracer, TracingUnavailable, trace_id_of
from ttserve.v1 import engine_pb2

from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreRequest, FinishReason

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


@pytest.fixture
def spans():
    """A tracer recording into memory: (tracer, exporter)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracer.otlp("http://collector.invalid:4317", "gateway", provider=provider), exporter


def json_app(status: int = 200, body: dict | None = None, seen: list | None = None):
    """An ASGI app answering `body` as JSON with `status`; the request headers it saw go to `seen`."""
    payload = json.dumps(body if body is not None else {"ok": True}).encode()

    async def app(scope, receive, send):
        if seen is not None:
            seen.append(dict((k.decode(), v.decode()) for k, v in scope["headers"]))
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
    return app


def call(app, path: str = "/v1/chat/completions", method: str = "POST", headers=()):
    """Runs one HTTP request through `app`; the messages it sent, in order."""
    sent: list[dict] = []
    scope = {"type": "http", "method": method, "path": path, "scheme": "http", "http_version": "1.1",
             "headers": [(k.encode(), v.encode()) for k, v in headers]}

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def response_headers(sent) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in sent[0]["headers"]}


def body_of(sent) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


# ---- the HTTP span -------------------------------------------------------------------------------
def test_a_request_with_a_client_traceparent_is_a_child_span_and_the_app_sees_the_http_spans(spans):
    tracer, exporter = spans
    seen: list[dict] = []
    sent = call(TracingMiddleware(json_app(seen=seen), tracer),
                headers=[("traceparent", CLIENT_PARENT), ("tracestate", "vendor=x"), ("x-other", "1")])
    (span,) = exporter.get_finished_spans()
    assert span.name == "POST"  # no route matched in a bare ASGI app: the method alone
    assert span.kind == SpanKind.SERVER
    assert format(span.context.trace_id, "032x") == CLIENT_TRACE
    assert format(span.parent.span_id, "016x") == CLIENT_SPAN and span.parent.is_remote
    own = f"00-{CLIENT_TRACE}-{span.context.span_id:016x}-01"
    # The app (vLLM's serving layer) reads the HTTP span as the parent; tracestate stays.
    assert seen[0]["traceparent"] == own
    assert seen[0]["tracestate"] == "vendor=x" and seen[0]["x-other"] == "1"
    assert response_headers(sent)["traceresponse"] == own
    assert span.attributes["http.request.method"] == "POST"
    assert span.attributes["url.path"] == "/v1/chat/completions"
    assert span.attributes["http.response.status_code"] == 200
    assert span.status.status_code == StatusCode.UNSET


def test_without_a_client_traceparent_the_http_span_starts_a_trace(spans):
    tracer, exporter = spans
    seen: list[dict] = []
    sent = call(TracingMiddleware(json_app(seen=seen), tracer))
    (span,) = exporter.get_finished_spans()
    assert span.parent is None
    assert trace_id_of(seen[0]["traceparent"]) == format(span.context.trace_id, "032x")
    assert response_headers(sent)["traceresponse"] == seen[0]["traceparent"]


@pytest.mark.parametrize("client", [
    [("traceparent", "00-not-a-valid-parent-01"), ("tracestate", "vendor=x")],
    [("traceparent", CLIENT_PARENT), ("traceparent", CLIENT_PARENT), ("tracestate", "vendor=x")],  # repeated
])
def test_an_invalid_client_context_starts_a_new_trace_without_its_tracestate(spans, client):
    tracer, exporter = spans
    seen: list[dict] = []
    call(TracingMiddleware(json_app(seen=seen), tracer), headers=client)
    (span,) = exporter.get_finished_spans()
    assert span.parent is None and format(span.context.trace_id, "032x") != CLIENT_TRACE
    assert "tracestate" not in seen[0]
    assert trace_id_of(seen[0]["traceparent"]) == format(span.context.trace_id, "032x")


def test_a_client_trace_not_sampled_records_nothing_but_still_names_its_trace(spans):
    tracer, exporter = spans
    seen: list[dict] = []
    unsampled = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"
    sent = call(TracingMiddleware(json_app(400, {"error": {"message": "bad"}}, seen=seen), tracer),
                headers=[("traceparent", unsampled)])
    assert not exporter.get_finished_spans()  # the client's sampling decision holds downstream too
    assert trace_id_of(seen[0]["traceparent"]) == CLIENT_TRACE and seen[0]["traceparent"].endswith("-00")
    assert json.loads(body_of(sent))["error"]["message"] == f"bad (trace_id {CLIENT_TRACE})"


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics"])
def test_probes_get_no_span_and_pass_untouched(spans, path):
    tracer, exporter = spans
    seen: list[dict] = []
    sent = call(TracingMiddleware(json_app(seen=seen), tracer), path=path, method="GET",
                headers=[("traceparent", CLIENT_PARENT)])
    assert not exporter.get_finished_spans()
    assert seen[0]["traceparent"] == CLIENT_PARENT
    assert "traceresponse" not in response_headers(sent)


def test_the_span_ends_when_the_last_byte_of_a_stream_is_sent(spans):
    tracer, exporter = spans
    finished_while_streaming: list[int] = []

    async def stream(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(3):
            await send({"type": "http.response.body", "body": b'data: {"n": %d}\n\n' % i, "more_body": True})
            finished_while_streaming.append(len(exporter.get_finished_spans()))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        finished_while_streaming.append(len(exporter.get_finished_spans()))

    sent = call(TracingMiddleware(stream, tracer))
    assert finished_while_streaming == [0, 0, 0, 1]  # ended by the last chunk, before the app returned
    assert body_of(sent).count(b"data: ") == 4
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.UNSET


def test_an_app_that_raises_ends_the_span_as_an_error(spans):
    tracer, exporter = spans

    async def broken(scope, receive, send):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        call(TracingMiddleware(broken, tracer))
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR and "boom" in span.status.description


# ---- the trace id in error responses -------------------------------------------------------------
@pytest.mark.parametrize("status, span_error", [(400, False), (503, True)])
def test_an_error_body_gets_the_trace_id_in_its_message(spans, status, span_error):
    tracer, exporter = spans
    error = {"error": {"message": "the request is bad", "type": "BadRequestError", "param": None,
                       "code": status}}
    sent = call(TracingMiddleware(json_app(status, error), tracer), headers=[("traceparent", CLIENT_PARENT)])
    body = body_of(sent)
    assert json.loads(body)["error"]["message"] == f"the request is bad (trace_id {CLIENT_TRACE})"
    headers = response_headers(sent)
    assert int(headers["content-length"]) == len(body)
    assert trace_id_of(headers["traceresponse"]) == CLIENT_TRACE
    (span,) = exporter.get_finished_spans()
    assert span.attributes["http.response.status_code"] == status
    # A 4xx is the client's: only a 5xx marks the server span as an error.
    assert (span.status.status_code == StatusCode.ERROR) is span_error


def test_an_error_body_of_another_shape_passes_unchanged(spans):
    tracer, _ = spans
    sent = call(TracingMiddleware(json_app(404, {"detail": "Not Found"}), tracer))
    assert json.loads(body_of(sent)) == {"detail": "Not Found"}
    assert "traceresponse" in response_headers(sent)


def test_a_streamed_error_event_gets_the_trace_id_and_marks_the_span(spans):
    tracer, exporter = spans
    chat_error = json.dumps({"error": {"message": "the worker was lost", "type": "InternalServerError",
                                       "param": None, "code": 500}})
    responses_error = json.dumps({"type": "error", "code": "x", "message": "failed", "param": None,
                                  "sequence_number": 3})
    content = json.dumps({"choices": [{"delta": {"content": 'say "error"'}}]})
    chunks = [f"data: {content}\n\n", f"data: {chat_error}\n\n", f"event: error\ndata: {responses_error}\n\n",
              "data: [DONE]\n\n"]

    async def stream(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        for i, chunk in enumerate(chunks):
            await send({"type": "http.response.body", "body": chunk.encode(), "more_body": i < len(chunks) - 1})

    sent = call(TracingMiddleware(stream, tracer), headers=[("traceparent", CLIENT_PARENT)])
    got = [m["body"].decode() for m in sent[1:]]
    assert got[0] == chunks[0]  # "error" in generated text is no error event
    suffix = f" (trace_id {CLIENT_TRACE})"
    assert json.loads(got[1].removeprefix("data: "))["error"]["message"] == "the worker was lost" + suffix
    event, data = got[2].split("\n")[:2]
    assert event == "event: error" and json.loads(data.removeprefix("data: "))["message"] == "failed" + suffix
    assert got[3] == chunks[3]
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR and span.status.description == "the worker was lost"


# ---- on vLLM's app, with the gateway's other middleware ------------------------------------------
def fastapi_app(tracer, api_keys=None):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    from ttserve.gateway.errors import ControlPlaneUnavailable, record_refusal
    from ttserve.gateway.server import install_middleware

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: dict):
        return JSONResponse({"ok": True})

    @app.get("/v1/models/{model}")
    async def model(model: str):
        return JSONResponse({"id": model})

    @app.post("/v1/completions")
    async def refused_stream():
        async def events():
            record_refusal(ControlPlaneUnavailable("the control plane is unreachable; retry later"))
            yield "data: {}\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    install_middleware(app, api_keys, tracer=tracer)
    return app


def http(app, method: str, path: str, **kwargs):
    import httpx

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            return await client.request(method, path, **kwargs)
    return asyncio.run(go())


def test_off_the_middleware_is_not_installed_and_on_it_is_outermost(spans):
    from fastapi import FastAPI

    from ttserve.gateway.server import install_middleware

    off = FastAPI()
    install_middleware(off, tracer=Tracer.off())
    assert not isinstance(off.middleware_stack, TracingMiddleware)
    on = FastAPI()
    install_middleware(on, tracer=spans[0])
    # Around the whole built stack, Starlette's ServerErrorMiddleware (the 500s) included.
    assert isinstance(on.middleware_stack, TracingMiddleware)


def test_a_500_from_an_unhandled_exception_carries_the_trace_id(spans):
    # vLLM registers a handler for Exception (exception_handling/register.py), which Starlette
    # runs in ServerErrorMiddleware, outside every user middleware: the tracing layer must be
    # outside that too, or the answer that most needs a trace id gets none.
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from ttserve.gateway.server import install_middleware

    tracer, exporter = spans
    app = FastAPI()

    @app.exception_handler(Exception)
    async def handler(request, exc):
        return JSONResponse({"error": {"message": f"engine fell over: {exc}", "type": "InternalServerError",
                                       "code": 500}}, status_code=500)

    @app.post("/v1/chat/completions")
    async def chat(request: dict):
        raise RuntimeError("boom")

    install_middleware(app, tracer=tracer)
    import httpx

    async def go():  # Starlette re-raises after its 500 is sent (uvicorn logs it): not the client's
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.post("/v1/chat/completions", json={})
    response = asyncio.run(go())
    (span,) = exporter.get_finished_spans()
    trace_id = format(span.context.trace_id, "032x")
    assert response.status_code == 500 and trace_id in response.headers["traceresponse"]
    assert response.json()["error"]["message"].endswith(f"(trace_id {trace_id})")


def test_on_the_gateways_app_the_span_is_named_by_its_route(spans):
    tracer, exporter = spans
    app = fastapi_app(tracer)
    assert http(app, "GET", "/v1/models/abc").status_code == 200
    assert http(app, "GET", "/no/such/path").status_code == 404
    named, unrouted = exporter.get_finished_spans()
    assert named.name == "GET /v1/models/{model}" and named.attributes["http.route"] == "/v1/models/{model}"
    assert unrouted.name == "GET" and "http.route" not in unrouted.attributes


def test_a_401_from_the_key_check_carries_the_trace_id(spans):
    from ttserve.gateway.api_keys import load_api_keys

    tracer, exporter = spans
    app = fastapi_app(tracer, api_keys=load_api_keys(["sk-secret"], None))
    reply = http(app, "POST", "/v1/chat/completions", json={}, headers={"traceparent": CLIENT_PARENT})
    assert reply.status_code == 401
    assert reply.json()["error"]["message"].endswith(f" (trace_id {CLIENT_TRACE})")
    assert trace_id_of(reply.headers["traceresponse"]) == CLIENT_TRACE
    assert exporter.get_finished_spans()[0].attributes["http.response.status_code"] == 401


def test_a_refused_stream_becomes_a_json_error_with_the_trace_id(spans):
    tracer, exporter = spans
    app = fastapi_app(tracer)
    reply = http(app, "POST", "/v1/completions", headers={"traceparent": CLIENT_PARENT})
    assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
    assert reply.json()["error"]["message"] == (f"the control plane is unreachable; retry later "
                                               f"(trace_id {CLIENT_TRACE})")
    (span,) = exporter.get_finished_spans()
    assert span.name == "POST /v1/completions" and span.status.status_code == StatusCode.ERROR


# ---- the engine request: AddRequest, ids, vLLM's llm_request span ---------------------------------
def core_request(request_id: str = "chatcmpl-1-abcd1234", trace_headers=None) -> EngineCoreRequest:
    sp = SamplingParams(max_tokens=4)
    sp.update_from_generation_config({}, 2)
    request = EngineCoreRequest(request_id=request_id, prompt_token_ids=[1, 2, 3], mm_features=None,
                                sampling_params=sp, pooling_params=None, arrival_time=1234.5,
                                lora_request=None, cache_salt=None, data_parallel_rank=None,
                                trace_headers=trace_headers)
    request.external_req_id = "chatcmpl-1"
    return request


def test_add_request_carries_the_trace_headers():
    headers = {"traceparent": CLIENT_PARENT, "tracestate": "vendor=x"}
    assert dict(convert.to_add_request(core_request(trace_headers=headers)).trace_headers) == headers
    assert not convert.to_add_request(core_request()).trace_headers  # untraced: empty


def test_every_output_of_a_request_carries_its_trace_headers():
    # The frontend itself may finish a request on any output (a stop string its detokenizer
    # finds), and vLLM's llm_request span is parented by that output's trace_headers.
    headers = {"traceparent": CLIENT_PARENT}
    track = convert.RequestTrack.of(core_request(trace_headers=headers))
    first = convert.to_engine_core_output(engine_pb2.RequestOutput(request_id="r", new_token_ids=[5]), track)
    last = convert.to_engine_core_output(engine_pb2.RequestOutput(
        request_id="r", new_token_ids=[6], finish_reason=engine_pb2.FINISH_REASON_LENGTH), track)
    assert first.trace_headers == headers and last.trace_headers == headers
    assert convert.finished_output("r", FinishReason.ERROR, track.trace_headers).trace_headers == headers
    assert convert.RequestTrack.of(core_request()).trace_headers is None


def test_the_engine_requests_ids_go_on_the_http_span_and_headers_fill_in(spans):
    tracer, exporter = spans
    passed, bare = core_request(trace_headers={"traceparent": CLIENT_PARENT}), core_request("chatcmpl-1-ffff0000")
    http_tracing.note_request(bare)  # outside a traced request: nothing
    assert bare.trace_headers is None

    async def serving(scope, receive, send):  # as vLLM's serving layer calls the engine client
        http_tracing.note_request(passed)
        http_tracing.note_request(bare)  # a serving path that passed no trace headers
        await json_app()(scope, receive, send)

    call(TracingMiddleware(serving, tracer))
    (span,) = exporter.get_finished_spans()
    assert span.attributes["gen_ai.request.id"] == "chatcmpl-1"
    assert tuple(span.attributes["ttserve.request_id"]) == ("chatcmpl-1-abcd1234", "chatcmpl-1-ffff0000")
    assert passed.trace_headers == {"traceparent": CLIENT_PARENT}
    assert trace_id_of(bare.trace_headers["traceparent"]) == format(span.context.trace_id, "032x")


def test_vllms_llm_request_span_is_a_child_of_the_http_span(spans, monkeypatch):
    """vLLM's OutputProcessor, as GatewayLLM runs it (log stats on), on the outputs the gateway
    builds: its llm_request span takes the request's trace headers as parent and raises nothing."""
    from vllm.tracing import extract_trace_context
    from vllm.v1.engine import output_processor as vllm_output_processor
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
    from vllm.v1.metrics.stats import IterationStats

    tracer, exporter = spans
    provider_tracer = tracer._provider.get_tracer("vllm")

    def instrument_manual(span_name, start_time, end_time=None, attributes=None, context=None, kind=None):
        provider_tracer.start_span(span_name, context=context, start_time=start_time,
                                   attributes=attributes, kind=kind).end(end_time)

    monkeypatch.setattr(vllm_output_processor, "instrument_manual", instrument_manual)
    assert extract_trace_context({"traceparent": CLIENT_PARENT}) is not None
    http_span = tracer.start("POST /v1/chat/completions", kind="server")
    request = core_request(trace_headers=http_span.headers())
    processor = OutputProcessor(None, log_stats=True, tracing_enabled=True)
    processor.add_request(request, None, None, 0, RequestOutputCollector(request.sampling_params.output_kind,
                                                                         request.request_id))
    track = convert.RequestTrack.of(request)
    for out in (engine_pb2.RequestOutput(request_id=request.request_id, new_token_ids=[7]),
                engine_pb2.RequestOutput(request_id=request.request_id, new_token_ids=[8],
                                         finish_reason=engine_pb2.FINISH_REASON_STOP)):
        processor.process_outputs([convert.to_engine_core_output(out, track)], 1.0, IterationStats())
    http_span.end()
    llm_request = next(s for s in exporter.get_finished_spans() if s.name == "llm_request")
    assert llm_request.parent.span_id == int(http_span.traceparent.split("-")[2], 16)
    assert format(llm_request.context.trace_id, "032x") == http_span.trace_id
    assert llm_request.attributes["gen_ai.request.id"] == "chatcmpl-1"


def test_without_log_stats_vllms_llm_request_span_is_off_so_the_output_loop_cannot_raise(smollm2, monkeypatch):
    from vllm.v1.engine import async_llm

    from ttserve.gateway.engine_client import GatewayLLM, GrpcEngineCoreClient
    from ttserve.gateway.server import build_vllm_config, parse_vllm_args

    monkeypatch.setattr(async_llm, "init_tracer", lambda *a, **k: None)  # no process-wide provider here
    args = parse_vllm_args(["--model", str(smollm2), "--otlp-traces-endpoint", "http://127.0.0.1:1"])
    config = build_vllm_config(args, engine_pb2.ModelInfo(max_model_len=2048, block_size=32, num_blocks=128))

    async def tracing_enabled(log_stats: bool) -> bool:
        llm = GatewayLLM(config, GrpcEngineCoreClient("127.0.0.1:1"), log_stats=log_stats)
        try:
            return llm.output_processor.tracing_enabled and await llm.is_tracing_enabled()
        finally:
            llm.shutdown()

    assert asyncio.run(tracing_enabled(True)) is True
    assert asyncio.run(tracing_enabled(False)) is False


# ---- start-up ------------------------------------------------------------------------------------
def test_the_gateway_takes_the_endpoint_and_hands_it_to_vllm():
    import argparse

    from ttserve.gateway import config
    from ttserve.gateway.server import vllm_argv

    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    args = parser.parse_args(["--otlp-traces-endpoint", "http://127.0.0.1:4317"])
    argv = vllm_argv(args, "/models/m", engine_pb2.ModelInfo(max_model_len=2048))
    assert argv[argv.index("--otlp-traces-endpoint") + 1] == "http://127.0.0.1:4317"
    assert "--otlp-traces-endpoint" not in vllm_argv(parser.parse_args([]), "/models/m",
                                                     engine_pb2.ModelInfo(max_model_len=2048))


def test_prepare_names_the_service_unless_set(monkeypatch):
    import os

    monkeypatch.setenv("OTEL_SERVICE_NAME", "")  # recorded, so that the test leaves it as it was
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    http_tracing.prepare(None)
    assert "OTEL_SERVICE_NAME" not in os.environ
    http_tracing.prepare("http://127.0.0.1:4317")
    assert os.environ["OTEL_SERVICE_NAME"] == "ttserve-gateway"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-gateway")
    http_tracing.prepare("http://127.0.0.1:4317")
    assert os.environ["OTEL_SERVICE_NAME"] == "edge-gateway"


def test_without_the_opentelemetry_exporter_the_gateway_refuses_to_start(monkeypatch):
    from argparse import Namespace

    from ttserve.gateway.server import ConfigRefused, prepare_tracing

    missing = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
    monkeypatch.setitem(sys.modules, missing, None)  # import raises ModuleNotFoundError
    with pytest.raises(TracingUnavailable, match="pip install 'ttserve\\[tracing\\]'"):
        http_tracing.prepare("http://127.0.0.1:4317")
    with pytest.raises(ConfigRefused) as refused:
        prepare_tracing(Namespace(otlp_traces_endpoint="http://127.0.0.1:4317"))
    assert refused.value.status == 2 and missing in str(refused.value)
    prepare_tracing(Namespace(otlp_traces_endpoint=None))  # off: nothing to check
