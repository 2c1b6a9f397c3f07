"""One trace per request across the three services: every service exports OTLP to a real
receiver on loopback (tests/otlp_receiver.py, the collector's gRPC protocol), and a streamed chat
sent with a client's `traceparent` appears there as one trace: the gateway's HTTP span under the
client's span, the control plane's request span under it (admission, queue, prefill chunks,
decode), and the worker's step spans under that. A request whose worker is SIGKILLed mid-run
stays one trace: a migration span, and the surviving worker's steps in it."""
from __future__ import annotations

import logging
import re
import signal
import time

import openai
import pytest

from otlp_receiver import OtlpReceiver, ReceivedSpan
from stack import start_stack
from ttserve.control_client import ControlClient
from ttserve.v1 import engine_pb2

pytestmark = pytest.mark.e2e

# Export within a fraction of a second (BatchSpanProcessor's default delay is 5 s).
ENV = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def receiver():
    r = OtlpReceiver()
    yield r
    r.stop()


def tracing_flags(receiver: OtlpReceiver) -> tuple[str, ...]:
    return ("--otlp-traces-endpoint", receiver.endpoint)


def by_id(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    return {s.span_id: s for s in spans}


def assert_tree(spans: list[ReceivedSpan], root_parent: str) -> None:
    """Every span's parent is in the trace, but the root's, which is the client's span."""
    ids = by_id(spans)
    orphans = [(s.service, s.name) for s in spans if s.parent_span_id not in ids and s.parent_span_id != root_parent]
    assert not orphans, f"spans whose parent is not in the trace: {orphans}"


def chain(span: ReceivedSpan, spans: list[ReceivedSpan]) -> list[str]:
    """service/name of span and each ancestor, innermost first."""
    ids, out = by_id(spans), []
    while span is not None:
        out.append(f"{span.service}/{span.name}")
        span = ids.get(span.parent_span_id)
    return out


def test_a_streamed_chat_is_one_trace_across_gateway_control_plane_and_worker(tmp_path, smollm2, receiver):
    flags = tracing_flags(receiver)
    stack = start_stack(tmp_path, str(smollm2), worker_flags=flags,
                        control_flags=(*flags, "--collect-detailed-traces", "worker"),
                        gateway_flags=flags, env=ENV)
    try:
        client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Count to twenty."}],
            max_tokens=40, temperature=0, stream=True,
            extra_headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text
        spans = receiver.wait_for(CLIENT_TRACE, {"ttserve-gateway", "ttserve-control", "ttserve-worker"},
                                  names={"ttserve.request", "decode", "ttserve.worker.step"})
    finally:
        stack.stop()
    assert_tree(spans, CLIENT_SPAN)
    names = {(s.service, s.name) for s in spans}
    for expected in [("ttserve-control", "admission"), ("ttserve-control", "queue"), ("ttserve-control", "prefill"),
                     ("ttserve-control", "decode")]:
        assert expected in names, names
    http = [s for s in spans if s.service == "ttserve-gateway" and s.parent_span_id == CLIENT_SPAN]
    assert len(http) == 1 and "chat/completions" in http[0].name, [(s.name, s.parent_span_id) for s in spans]
    request = next(s for s in spans if s.name == "ttserve.request")
    # The control plane's span hangs under the gateway's: through vLLM's frontend and AddRequest.
    assert chain(request, spans)[-1].startswith("ttserve-gateway/"), chain(request, spans)
    assert request.attributes["gen_ai.usage.completion_tokens"] == 40
    decode = next(s for s in spans if s.name == "decode")
    assert decode.parent_span_id == request.span_id and decode.attributes["gen_ai.usage.completion_tokens"] == 40
    steps = [s for s in spans if s.name == "ttserve.worker.step"]
    kinds = {s.attributes["ttserve.step.kind"] for s in steps}
    assert kinds == {"prefill", "decode"}, kinds
    assert all(s.parent_span_id == request.span_id for s in steps)
    # 1 prefill step and a sample of the decode steps (the first and one in 16): not one per token.
    assert len(steps) < 10, len(steps)


def test_the_request_log_line_carries_the_trace_id(tmp_path, smollm2, receiver):
    flags = tracing_flags(receiver)
    stack = start_stack(tmp_path, str(smollm2), gateway=False, worker_flags=flags, control_flags=flags, env=ENV)
    client = ControlClient(stack.control_address)
    try:
        add = engine_pb2.AddRequest(request_id="traced", prompt_token_ids=[1, 2, 3, 4],
                                    sampling=engine_pb2.SamplingParams(max_tokens=3))
        add.trace_headers["traceparent"] = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
        client.add_request(add)
        client.collect({"traced"})
        spans = receiver.wait_for(CLIENT_TRACE, {"ttserve-control"}, names={"ttserve.request"})
        deadline = time.monotonic() + 10
        control_log = next(s.log_path for s in stack.services if s.name == "control")
        while f"trace_id={CLIENT_TRACE}" not in control_log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        line = next(line for line in control_log.read_text().splitlines() if "request_finished" in line
                    and '"traced"' in line)
    finally:
        client.close()
        stack.stop()
    assert re.search(rf"trace_id={CLIENT_TRACE}\b", line), line
    request = next(s for s in spans if s.name == "ttserve.request")
    assert request.parent_span_id == CLIENT_SPAN
    # Without --collect-detailed-traces the worker records no steps.
    assert not [s for s in receiver.trace(CLIENT_TRACE) if s.service == "ttserve-worker"]


def test_a_request_whose_worker_is_killed_stays_one_trace(tmp_path, smollm2, hf_smollm2, receiver):
    from test_e2e_migration import rest, stream
    tokenizer, _ = hf_smollm2
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about lighthouses."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    flags = tracing_flags(receiver)
    stack = start_stack(tmp_path, str(smollm2), gateway=False, workers=2, worker_flags=flags,
                        control_flags=(*flags, "--collect-detailed-traces", "all"), env=ENV)
    client = ControlClient(stack.control_address)
    try:
        add = engine_pb2.AddRequest(request_id="moved", prompt_token_ids=prompt,
                                    sampling=engine_pb2.SamplingParams(max_tokens=64, ignore_eos=True))
        add.trace_headers["traceparent"] = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
        client.add_request(add)
        head = stream(client, "moved", 12)
        assert head.placements == {(0, 0)} and not head.finish_reason
        stack.services[0].stop(signal.SIGKILL)
        result = rest(client, "moved", head)
        assert result.finish_reason == engine_pb2.FinishReason.FINISH_REASON_LENGTH, result.error
        spans = receiver.wait_for(CLIENT_TRACE, {"ttserve-control", "ttserve-worker"},
                                  names={"ttserve.request", "migration"})
    finally:
        client.close()
        stack.stop()
    assert_tree(spans, CLIENT_SPAN)
    request = next(s for s in spans if s.name == "ttserve.request")
    migration = next(s for s in spans if s.name == "migration")
    assert migration.parent_span_id == request.span_id
    assert migration.attributes["ttserve.from_worker"] == "0" and migration.attributes["ttserve.to_worker"] == "1"
    assert request.attributes["ttserve.migrations"] == 1
    # The recompute on the surviving worker: a prefill chunk of prompt + the tokens it had, and
    # its worker step, in the same trace (the killed worker's unexported spans died with it).
    prefills = sorted((s for s in spans if s.name == "prefill"), key=lambda s: s.start_ns)
    assert prefills[-1].attributes["ttserve.worker"] == "1"
    assert prefills[-1].attributes["ttserve.chunk.end"] >= len(prompt) + 12
    assert any(s.name == "ttserve.worker.step" and s.attributes["ttserve.step.kind"] == "prefill"
               and s.start_ns >= migration.start_ns for s in spans)
