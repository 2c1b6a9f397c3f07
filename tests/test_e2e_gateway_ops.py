"""Operating the gateway through real processes: /metrics, /ready, and the drain on SIGTERM.

One worker (the simulated mesh, see SIM_WORKER) and one control plane serve the module; the tests
that end a gateway (SIGTERM) or the control plane each have a process of their own, started in the
background when the module starts so that their start-up overlaps the tests before them. The
control plane is stopped by the last test of the module.
"""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from stack import (DEFAULT_SHUTDOWN_TIMEOUT_S, Service, Stack, free_port, get, http_ok, sample, start_stack,
                   wait_until)

# The module's worker runs the simulated mesh with a T3K's step times (~63 ms a decode step, no
# arithmetic): no test here reads generated text, and a stream's length in time is then set by
# the profile, not by how busy the host is. 200 tokens are ~13 s of decode, which the drain test
# needs to outlast its requests made after SIGTERM.
SIM_WORKER = ("--backend", "sim", "--sim-profile", "t3k-llama-3.3-70b")
DRAINED_STREAM_TOKENS = 200

GATEWAY_METRICS = ("ttserve_gateway_control_plane_connected",
                   "ttserve_gateway_control_plane_sessions_lost_total",
                   "ttserve_gateway_refused_requests_total",
                   "ttserve_gateway_draining",
                   "ttserve_gateway_request_duration_seconds")


class Gateway:
    """A gateway process of its own on the module's control plane."""

    def __init__(self, tmp: Path, control_address: str, *flags: str) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.service = Service("gateway", ["ttserve.gateway", "--port", str(port), "--control",
                                           control_address, *flags],
                               tmp / f"gateway-{port}.log").start()

    def wait_serving(self) -> "Gateway":
        wait_until(lambda: http_ok(f"{self.url}/health"), 300, "the gateway to serve",
                   Stack(services=[self.service]))
        return self

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm2):
    tmp = tmp_path_factory.mktemp("ops")
    s = start_stack(tmp, str(smollm2), worker_flags=SIM_WORKER)
    extra = {"short": Gateway(tmp, s.control_address, "--shutdown-timeout", "1"),
             "readiness": Gateway(tmp, s.control_address)}
    s.extra_gateways = extra  # type: ignore[attr-defined]
    yield s
    for gateway in extra.values():
        gateway.service.stop()
    s.stop()


def gateway_service(stack: Stack) -> Service:
    return stack.services[-1]


def stream_completion(url: str, model_name: str, max_tokens: int):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0).completions.create(
        model=model_name, prompt="Once upon a time", max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        timeout=120)


# ---- /metrics -------------------------------------------------------------------------------
@pytest.mark.e2e
def test_metrics_name_the_gateway_metrics_and_no_vllm_ones(stack, client, model_name):
    assert client.completions.create(model=model_name, prompt="Hi", max_tokens=2).choices
    response = httpx.get(f"{stack.http_url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert "vllm:" not in text
    for name in GATEWAY_METRICS:
        assert f"# TYPE {name.removesuffix('_total')}" in text, name
    assert sample(text, "ttserve_gateway_control_plane_connected") == 1
    assert sample(text, "ttserve_gateway_draining") == 0
    # Both statuses are exported from the start, at 0 until a refusal: nothing was refused yet.
    assert sample(text, "ttserve_gateway_refused_requests_total", status="503") == 0
    assert sample(text, "ttserve_gateway_refused_requests_total", status="400") == 0
    assert sample(text, "ttserve_gateway_request_duration_seconds_count", endpoint="completions") >= 1
    # Nothing of vLLM's is served below /metrics either.
    assert get(f"{stack.http_url}/metrics/vllm")[0] == 404


# ---- /ready ---------------------------------------------------------------------------------
@pytest.mark.e2e
def test_ready_is_200_on_a_ready_stack(stack):
    status, body = get(f"{stack.http_url}/ready")
    assert status == 200, body
    assert json.loads(body) == {"status": "ready"}
    assert get(f"{stack.http_url}/health")[0] == 200


# ---- the drain on SIGTERM -------------------------------------------------------------------
@pytest.mark.e2e
def test_sigterm_lets_a_stream_finish_refuses_new_requests_and_exits_0(stack, model_name):
    gateway = gateway_service(stack)
    refused_before = sample(get(f"{stack.http_url}/metrics")[1], "ttserve_gateway_refused_requests_total",
                            status="503")
    stream = stream_completion(stack.http_url, model_name, max_tokens=DRAINED_STREAM_TOKENS)
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices and first.choices[0].finish_reason is None
    gateway.proc.send_signal(signal.SIGTERM)
    # /health turns 503 once the drain has begun; from then on nothing is admitted. The gateway
    # exits once nothing is in flight, so all of this happens while the stream still runs.
    wait_until(lambda: get(f"{stack.http_url}/health")[0] == 503, 10, "/health to say draining")

    refused = httpx.post(f"{stack.http_url}/v1/completions", timeout=30,
                         json={"model": model_name, "prompt": "Hi", "max_tokens": 2})
    assert refused.status_code == 503, refused.text
    assert "shutting down" in refused.json()["error"]["message"]
    with httpx.stream("POST", f"{stack.http_url}/v1/chat/completions", timeout=30,
                      json={"model": model_name, "max_tokens": 2, "stream": True,
                            "messages": [{"role": "user", "content": "Hi"}]}) as response:
        assert response.status_code == 503
        assert "shutting down" in response.read().decode()
    refusals = 2
    status, body = get(f"{stack.http_url}/ready")
    assert status == 503 and "gateway is shutting down" in json.loads(body)["error"]["message"]
    metrics = get(f"{stack.http_url}/metrics")[1]
    assert sample(metrics, "ttserve_gateway_draining") == 1
    # Each refused request counts once; /health and /ready saying 503 are no refusals.
    assert sample(metrics, "ttserve_gateway_refused_requests_total", status="503") == refused_before + refusals

    rest = list(chunks)
    finish = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in rest if c.usage]
    assert finish == ["length"], finish
    assert usage and usage[-1].completion_tokens == DRAINED_STREAM_TOKENS
    assert gateway.proc.wait(timeout=60) == 0, gateway.output()[-4000:]
    assert "Traceback" not in gateway.output()


@pytest.mark.e2e
def test_shutdown_timeout_aborts_a_long_stream_and_exits_0(stack, model_name):
    gateway = stack.extra_gateways["short"].wait_serving()
    stream = stream_completion(gateway.url, model_name, max_tokens=2000)
    chunks = iter(stream)
    next(chunks)
    signalled = time.monotonic()
    gateway.service.proc.send_signal(signal.SIGTERM)
    rest: list = []
    # Read on a thread so that a stream left hanging fails the test instead of blocking it.
    reader = threading.Thread(target=lambda: rest.extend(chunks), daemon=True)
    reader.start()
    reader.join(timeout=60)
    assert not reader.is_alive(), "the stream was left hanging"
    finish = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
    assert finish == ["abort"], finish
    # --shutdown-timeout 1 cut the drain short: well before the default timeout would have.
    assert time.monotonic() - signalled < DEFAULT_SHUTDOWN_TIMEOUT_S - 5
    usage = [c.usage for c in rest if c.usage]
    assert not usage or usage[-1].completion_tokens < 2000
    assert gateway.service.proc.wait(timeout=60) == 0, gateway.service.output()[-4000:]


# ---- the drain and readiness logic without processes ---------------------------------------------
class FakeEngine:
    """A Drainable whose requests finish when told to."""

    def __init__(self, in_flight: int) -> None:
        self.in_flight = in_flight
        self.aborted = 0

    def num_in_flight(self) -> int:
        return self.in_flight

    async def abort_in_flight(self) -> int:
        self.aborted, self.in_flight = self.in_flight, 0
        return self.aborted


def test_drain_waits_for_requests_then_aborts_the_rest_or_stops_early_when_cut_short():
    from ttserve.gateway.drain import Drain

    # wait_for: a drain that ignores its timeout or cut_short fails the test instead of hanging it.
    hang_guard_s = 10

    async def scenario() -> None:
        finishing = FakeEngine(2)
        drain = Drain()
        asyncio.get_running_loop().call_later(0.1, lambda: setattr(finishing, "in_flight", 0))
        assert await asyncio.wait_for(drain.run(finishing, 5, signals=()), hang_guard_s) == 0
        assert drain.draining and finishing.aborted == 0

        stuck = FakeEngine(3)
        start = time.monotonic()
        assert await asyncio.wait_for(Drain().run(stuck, 0.2, signals=()), hang_guard_s) == 3
        assert time.monotonic() - start >= 0.2 and stuck.aborted == 3

        # cut_short ends a drain whose timeout (30 s) is longer than the hang guard.
        cut = Drain()
        asyncio.get_running_loop().call_later(0.1, cut.cut_short)
        assert await asyncio.wait_for(cut.run(FakeEngine(1), 30, signals=()), hang_guard_s) == 1

    asyncio.run(scenario())


def test_readiness_says_why_not():
    import grpc

    from ttserve.gateway.drain import Drain
    from ttserve.gateway.readiness import ReadinessProbe
    from ttserve.v1 import engine_pb2

    class FakeControlPlane:
        target = "cp:1"
        connected = True
        unreachable_message = "control plane at cp:1 is unreachable (UNAVAILABLE: gone)"
        info: engine_pb2.ServerInfo | None = None

        async def get_server_info(self, timeout: float) -> engine_pb2.ServerInfo:
            if self.info is None:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), "connection refused")
            return self.info

    async def reason(control: FakeControlPlane, drain: Drain | None = None) -> str | None:
        return await ReadinessProbe(control, drain or Drain(), cache_s=0).not_ready_reason()

    async def scenario() -> None:
        control = FakeControlPlane()
        assert "unreachable (UNAVAILABLE: connection refused)" in await reason(control)
        control.info = engine_pb2.ServerInfo(ready=False, workers=[
            engine_pb2.WorkerInfo(address="w:1", state="warming up: 3/10 shapes")])
        assert "no ready worker (worker w:1: warming up: 3/10 shapes)" in await reason(control)
        control.info = engine_pb2.ServerInfo(ready=False, draining=True)
        assert "control plane at cp:1 is shutting down" in await reason(control)
        control.info = engine_pb2.ServerInfo(ready=True)
        assert await reason(control) is None
        control.connected = False
        assert await reason(control) == control.unreachable_message
        draining = Drain()
        draining.begin()
        assert await reason(control, draining) == "the gateway is shutting down"

    asyncio.run(scenario())


# ---- the control plane's aborts ----------------------------------------------------------------
def test_a_control_plane_abort_with_a_message_reads_as_finish_reason_abort():
    """The control plane ends the requests it holds at shutdown with FINISH_REASON_ABORT and a
    message; the gateway hands vLLM finish reason ABORT (the API's "abort"), not ERROR (which
    vLLM turns into an internal-error response). No processes needed."""
    from vllm.v1.engine import FinishReason

    from ttserve.gateway import convert
    from ttserve.v1 import engine_pb2

    track = convert.RequestTrack(request_id="r", num_prompt_tokens=3, eos_token_id=2, started=True)
    out = engine_pb2.RequestOutput(request_id="r", finish_reason=engine_pb2.FINISH_REASON_ABORT,
                                   error="the control plane shut down")
    output = convert.to_engine_core_output(out, track)
    assert output is not None and output.finish_reason == FinishReason.ABORT
    assert str(output.finish_reason) == "abort"


# ---- last: the control plane goes away --------------------------------------------------------
@pytest.mark.e2e
def test_ready_says_why_once_the_control_plane_is_gone(stack):
    gateway = stack.extra_gateways["readiness"].wait_serving()
    wait_until(lambda: get(f"{gateway.url}/ready")[0] == 200, 30, "/ready to be 200")
    assert get(f"{gateway.url}/health")[0] == 200
    control = next(s for s in stack.services if s.name == "control")
    control.stop(signal.SIGTERM)

    reasons: list[str] = []

    def not_ready() -> bool:
        status, body = get(f"{gateway.url}/ready")
        if status != 503:
            return False
        reasons.append(json.loads(body)["error"]["message"])
        return "unreachable" in reasons[-1]

    wait_until(not_ready, 30, "/ready to say the control plane is unreachable")
    assert stack.control_address in reasons[-1]
    # /health is the gateway's own liveness: a lost control plane is /ready's business, and
    # restarting the gateway would not bring it back.
    assert get(f"{gateway.url}/health")[0] == 200
    assert gateway.service.alive()
