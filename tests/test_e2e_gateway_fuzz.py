"""The gateway's own OpenAPI schema, fuzzed (schemathesis): no route answers with a server error,
so every route it exposes either works or is not exposed. A simulated worker and a short
max_model_len keep each generated request to about a second at most. (Driven through hypothesis
directly: schemathesis' pytest plugin does not run under pytest 9.)"""
from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from stack import start_stack

pytestmark = pytest.mark.e2e

EXAMPLES_PER_ROUTE = 12
# CI replays the same examples every run (a red build names a regression, not an unlucky draw);
# TTSERVE_FUZZ_RANDOM=1 draws new ones, as a hunt for bugs.
DERANDOMIZE = os.environ.get("TTSERVE_FUZZ_RANDOM") != "1"


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory, smollm2):
    # A served example without max_tokens generates until the context is full (the sim's tokens
    # all but never give EOS), so max_model_len bounds its time (~15 ms a token). 64 still holds
    # every prompt of the replayed examples that a longer context serves (the longest: 53 tokens).
    stack = start_stack(tmp_path_factory.mktemp("gateway-fuzz"), str(smollm2),
                        worker_flags=("--backend", "sim", "--sim-profile", "galaxy-llama-3.3-70b"),
                        control_flags=("--max-model-len", "64"))
    yield stack.http_url
    stack.stop()


def test_no_route_answers_with_a_server_error(gateway_url):
    schema = schemathesis.openapi.from_url(f"{gateway_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= {op.path for op in operations}
    failures = []
    for operation in operations:
        @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None, derandomize=DERANDOMIZE)
        @given(case=operation.as_strategy())
        def call(case) -> None:
            response = case.call(timeout=60)
            case.validate_response(response, checks=[not_a_server_error])

        try:
            call()
        except Exception as e:  # noqa: BLE001 - collect every route's failure, then report them all
            failures.append(f"{operation.method.upper()} {operation.path}: {e}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("earlier", [
    {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
    {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed", "content": []},
], ids=["refusal-part", "no-parts"])
def test_responses_input_with_an_earlier_assistant_message_vllm_cannot_read_is_served(gateway_url, earlier):
    # Found by the fuzzer: vLLM 0.32 read only content[0].text of such a message (HTTP 500);
    # gateway/responses_input.py hands it the message's parts as one text.
    import httpx

    response = httpx.post(f"{gateway_url}/v1/responses", timeout=60, json={
        "model": "SmolLM2-135M-Instruct", "max_output_tokens": 4,
        "input": [earlier, {"role": "user", "content": "And now?"}]})
    assert response.status_code == 200, response.text
    assert response.json()["status"] in {"completed", "incomplete"}  # 4 tokens may cut it short


@pytest.mark.parametrize("route, body", [
    ("/v1/responses", {"input": "hi", "max_output_tokens": 4}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
])
def test_a_priority_beyond_the_wire_is_a_clear_400(gateway_url, route, body):
    # Found by the fuzzer: engine.proto's priority is an int32, and a larger one was a 500. Now
    # any priority but 0 is refused: requests are scheduled first come, first served.
    import httpx

    response = httpx.post(f"{gateway_url}{route}", timeout=60,
                          json={"model": "SmolLM2-135M-Instruct", "priority": 5081241299, **body})
    assert response.status_code == 400, response.text
    assert "priority 5081241299: this ttserve release schedules requests first come" in response.text


def _raw_post(url: str, head: bytes, body_chunks) -> bytes:
    """POST over a bare socket (a client that lies or streams), returning the response's bytes."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     + head + b"\r\n")
        try:
            for chunk in body_chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gateway answered and closed: what it said is still to be read
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
        return answer


def test_a_body_over_the_limit_is_a_413_before_it_is_read(gateway_url):
    # Declared: 1 GiB announced, 1 byte sent; the answer comes without waiting for the rest.
    answer = _raw_post(gateway_url, b"Content-Length: 1073741824\r\n", [b"{"])
    assert answer.startswith(b"HTTP/1.1 413") and b"--max-request-bytes" in answer, answer[:300]
    # Streamed: 65 MiB of chunks with no length; refused once past 64 MiB.
    chunk = b"4000\r\n" + b" " * 0x4000 + b"\r\n"
    answer = _raw_post(gateway_url, b"Transfer-Encoding: chunked\r\n", (chunk for _ in range(65 * 64)))
    assert answer.startswith(b"HTTP/1.1 413") and b"passed 67108864 bytes" in answer, answer[:300]
    assert httpx_ok(gateway_url)


def httpx_ok(url: str) -> bool:
    import httpx

    reply = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                       json={"model": "SmolLM2-135M-Instruct", "max_tokens": 2,
                             "messages": [{"role": "user", "content": "hi"}]})
    return reply.status_code == 200
