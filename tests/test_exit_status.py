"""Every service's exit status means one thing: 2 only for refused flags or unreadable files (a
restart cannot help: systemd's RestartPreventExitStatus=2, `ttserve up` stops the stack), 1 for
what a restart or a peer may fix, 0 after SIGTERM. Waiting for a peer never ends in 2: a gateway
waits for its control plane (answering /health 200, everything else 503 saying why) and exits 1
only past a --connect-timeout or --ready-timeout it was given."""
from __future__ import annotations

import asyncio
import json
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from certs import CertificateAuthority
from stack import Service, free_port, get, http_ok, start_worker, wait_until
from ttserve.gateway.api_keys import ApiKeys
from ttserve.gateway.server import bind_http_socket
from ttserve.gateway.waiting import WaitingResponder, http_ssl_context

WAITING = "waiting for the control plane at 127.0.0.1:1: unreachable (UNAVAILABLE: connection refused)"


def exit_of(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m ARGV` run to its end."""
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=timeout)


def message(body: str) -> str:
    return json.loads(body)["error"]["message"]


def absent_address() -> str:
    """An address where nothing listens."""
    return f"127.0.0.1:{free_port()}"


def start_control(tmp: Path, worker: str, *flags: str) -> Service:
    port = free_port()
    return Service("control", ["ttserve.control", "--port", str(port), "--worker", worker, "--metrics-port",
                               str(free_port()), *flags], tmp / f"control-{port}.log").start()


def control_address(control: Service) -> str:
    return f"127.0.0.1:{control.args[control.args.index('--port') + 1]}"


def metrics_url(service: Service) -> str:
    return f"http://127.0.0.1:{service.args[service.args.index('--metrics-port') + 1]}"


def start_gateway(tmp: Path, control: str, *flags: str) -> tuple[Service, str]:
    port = free_port()
    gateway = Service("gateway", ["ttserve.gateway", "--port", str(port), "--control", control, *flags],
                      tmp / f"gateway-{port}.log").start()
    return gateway, f"http://127.0.0.1:{port}"


def stopped(service: Service, timeout: float = 30) -> int | None:
    """SIGTERM's exit status (the service killed, and None, past `timeout`)."""
    status = service.stop(signal.SIGTERM, timeout=timeout)
    return None if status == -signal.SIGKILL else status


# ---- the gateway: refusals (2) --------------------------------------------------------------------

def test_gateway_unknown_flag_is_2():
    done = exit_of("ttserve.gateway", "--no-such-flag")
    assert done.returncode == 2 and "--no-such-flag" in done.stderr


def test_gateway_unreadable_api_key_file_is_2(tmp_path):
    done = exit_of("ttserve.gateway", "--port", str(free_port()), "--api-key-file", str(tmp_path / "missing"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--api-key-file" in done.stderr and "cannot read" in done.stderr


def test_gateway_bad_certificate_is_2(tmp_path):
    (tmp_path / "cert.pem").write_text("not a certificate")
    done = exit_of("ttserve.gateway", "--port", str(free_port()), "--ssl-certfile", str(tmp_path / "cert.pem"),
                   "--ssl-keyfile", str(tmp_path / "cert.pem"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--ssl-certfile" in done.stderr and "not a PEM file" in done.stderr


# ---- the gateway: waiting for its control plane (1 past a bound; else it waits) -----------------

@pytest.mark.e2e
def test_gateway_past_its_connect_timeout_is_1_naming_the_control_plane():
    control = absent_address()
    started = time.monotonic()
    done = exit_of("ttserve.gateway", "--port", str(free_port()), "--control", control, "--connect-timeout", "2")
    assert done.returncode == 1, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    assert f"control plane at {control} is unreachable (UNAVAILABLE" in line and "--connect-timeout" in line
    assert time.monotonic() - started < 60


@pytest.mark.e2e
def test_a_gateway_listing_several_control_planes_names_each_and_why(tmp_path):
    """--control A,B: past --connect-timeout the one line names both and what each answered."""
    first, second = absent_address(), absent_address()
    done = exit_of("ttserve.gateway", "--port", str(free_port()), "--control", f"{first},{second}",
                   "--connect-timeout", "2")
    assert done.returncode == 1, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    assert f"none of the control planes at {first}, {second} answered within 2 s: {first} unreachable (UNAVAILABLE" \
        in line, line
    assert f"; {second} unreachable (UNAVAILABLE" in line and "--connect-timeout" in line
    for bad, why in ((f"{first},,{second}", "expected HOST:PORT[,HOST:PORT...]"), (f"{first},{first}", "listed twice")):
        done = exit_of("ttserve.gateway", "--port", str(free_port()), "--control", bad)
        assert done.returncode == 2 and why in done.stderr, done.stderr[-2000:]


@pytest.mark.e2e
def test_gateway_without_a_timeout_waits_answering_health_and_ready_and_stops_with_0(tmp_path):
    control = absent_address()
    gateway, url = start_gateway(tmp_path, control)
    try:
        started = time.monotonic()
        wait_until(lambda: http_ok(f"{url}/health"), 60, "the waiting gateway's /health")
        # Beyond the old default --connect-timeout (10 s), which exited 2.
        time.sleep(max(0.0, 11 - (time.monotonic() - started)))
        assert gateway.alive(), gateway.output()[-3000:]
        assert get(f"{url}/health")[0] == 200
        status, body = get(f"{url}/ready")
        assert status == 503 and message(body).startswith(f"not ready: waiting for the control plane at {control}: "
                                                           "unreachable (UNAVAILABLE")
        chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": []}, timeout=10)
        assert chat.status_code == 503 and chat.headers["retry-after"]
        assert message(chat.text).startswith("waiting for the control plane: unreachable")
        assert control not in chat.text  # the control plane's address is the operator's (/ready, logs)
        assert f"waiting for the control plane at {control}" in gateway.output()  # the log says why
        assert stopped(gateway) == 0
    finally:
        gateway.stop(signal.SIGKILL)


@pytest.mark.e2e
def test_gateway_past_its_ready_timeout_is_1_naming_the_control_plane_and_its_workers(tmp_path):
    worker = absent_address()
    control = start_control(tmp_path, worker)
    try:
        address = control_address(control)
        done = exit_of("ttserve.gateway", "--port", str(free_port()), "--control", address, "--ready-timeout", "3")
        assert done.returncode == 1, done.stderr[-2000:]
        line = done.stderr.strip().splitlines()[-1]
        assert f"control plane at {address} did not become ready within 3 s: no ready worker" in line
        assert worker in line and "--ready-timeout" in line
    finally:
        control.stop()


@pytest.mark.e2e
def test_a_waiting_gateway_serves_once_a_worker_appears_without_a_restart(tmp_path, smollm2):
    import openai

    worker_port = free_port()
    control = start_control(tmp_path, f"127.0.0.1:{worker_port}")
    gateway, url = start_gateway(tmp_path, control_address(control))
    worker = None
    try:
        wait_until(lambda: "no ready worker" in message(get(f"{url}/ready")[1]), 60, "the gateway to wait for a worker")
        worker = start_worker(tmp_path, str(smollm2), worker_port, "--metrics-port", "0")
        wait_until(lambda: get(f"{url}/ready")[0] == 200, 300, "the gateway to serve")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model=smollm2.name, max_tokens=4,
                                             messages=[{"role": "user", "content": "Hello!"}])
        assert out.choices[0].message.content
        assert gateway.alive() and "ready after" in gateway.output()
        assert stopped(gateway) == 0
    finally:
        for service in (gateway, worker, control):
            if service is not None:
                service.stop()


# ---- the control plane and the worker -----------------------------------------------------------

@pytest.mark.parametrize("service, flags, words", [
    ("control", ["--no-such-flag"], "--no-such-flag"),
    ("control", ["--max-num-seqs", "0"], "--max-num-seqs"),
    ("control", ["--ssl-certfile", "/missing.crt", "--ssl-keyfile", "/missing.key"],
     "--ssl-certfile /missing.crt: cannot read"),
    ("worker", ["--no-such-flag"], "--no-such-flag"),
    ("worker", ["--model", "/no/such/folder"], "unknown model '/no/such/folder'")])
def test_control_plane_and_worker_refusals_are_2(service, flags, words):
    done = exit_of(f"ttserve.{service}", "--port", str(free_port()), "--metrics-port", "0", *flags)
    assert done.returncode == 2 and words in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("service, flags", [
    ("worker", ["--metrics-port", "0", "--num-threads", "-1"]),
    ("worker", ["--metrics-port", "0", "--model", "/no/such/folder"]),
    ("worker", ["--metrics-port", "0", "--backend", "ttnn"]),  # on a host without ttnn
    ("control", ["--metrics-port", "0", "--max-num-seqs", "0"]),
    ("gateway", ["--api-key-file", "/no/such/keys"])])
def test_a_refusal_comes_before_torch_and_vllm_are_imported(service, flags):
    """An operator's typo is answered in a fraction of a second, not after seconds of torch (the
    worker) or vLLM (the gateway) imports; the refusal tests above stay cheap for the same reason."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", f"ttserve.{service}", "--port", str(free_port()),
                           *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"torch", "vllm", "transformers"}, sorted(imported & {"torch", "vllm", "transformers"})


@pytest.mark.e2e
def test_control_plane_waiting_for_an_absent_worker_stops_with_0_on_sigterm(tmp_path):
    control = start_control(tmp_path, absent_address(), "--shutdown-timeout", "2")
    try:
        wait_until(lambda: http_ok(f"{metrics_url(control)}/health"), 60, "the control plane")
        started = time.monotonic()
        assert stopped(control, timeout=20) == 0, control.output()[-3000:]
        assert time.monotonic() - started < 2 + 5  # its --shutdown-timeout, and the time to exit
    finally:
        control.stop(signal.SIGKILL)


@pytest.mark.e2e
def test_worker_stops_with_0_on_sigterm(tmp_path, smollm2):
    worker = start_worker(tmp_path, str(smollm2), None, "--backend", "sim")
    try:
        wait_until(lambda: http_ok(f"{metrics_url(worker)}/health"), 120, "the worker")
        assert stopped(worker) == 0, worker.output()[-3000:]
    finally:
        worker.stop(signal.SIGKILL)


# ---- ttserve up ---------------------------------------------------------------------------------

@pytest.mark.e2e
def test_up_stops_the_stack_with_2_when_one_service_refuses_its_flags(tmp_path):
    """The worker refuses its --model; the control plane and the gateway (waiting for it) are
    stopped, and up exits 2."""
    ports = [str(free_port()) for _ in range(5)]
    with open(tmp_path / "up.log", "wb") as log:
        up = subprocess.Popen([sys.executable, "-m", "ttserve.cli", "up", "--model", "/no/such/folder",
                               "--port", ports[0], "--control-port", ports[1], "--worker-port", ports[2],
                               "--control-metrics-port", ports[3], "--worker-metrics-port", ports[4]],
                              stdout=log, stderr=subprocess.STDOUT)
    children: set[int] = set()
    try:
        while up.poll() is None:
            found = subprocess.run(["pgrep", "-P", str(up.pid)], capture_output=True, text=True).stdout.split()
            children |= {int(pid) for pid in found}
            time.sleep(0.1)
        output = (tmp_path / "up.log").read_text()
        assert up.returncode == 2, output[-4000:]
        assert "worker refused its configuration (exit code 2); stopping the stack" in output
        assert len(children) >= 2  # the control plane and the gateway at least were running
        alive = [pid for pid in children if Path(f"/proc/{pid}").exists()]
        assert not alive, output[-4000:]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


# ---- the waiting gateway's port, in process -------------------------------------------------------

def _waiting(keys: ApiKeys, ssl_context: ssl.SSLContext | None, requests):
    """Run a WaitingResponder (showing WAITING) on a fresh socket; `requests(base_url)` runs on a
    thread meanwhile and its result is returned."""
    async def scenario():
        sock = bind_http_socket("127.0.0.1", 0)
        responder = WaitingResponder(sock, keys, ssl_context=ssl_context)
        try:
            await responder.show(WAITING)
            scheme = "https" if ssl_context else "http"
            return await asyncio.to_thread(requests, f"{scheme}://127.0.0.1:{sock.getsockname()[1]}")
        finally:
            await responder.close()
            sock.close()
    return asyncio.run(scenario())


def test_the_waiting_port_keeps_the_api_key_rules_over_https(tmp_path):
    ca = CertificateAuthority(tmp_path / "ca", "waiting-ca")
    files = ca.issue("gateway")

    def requests(url: str) -> dict[str, tuple[int, str]]:
        with httpx.Client(base_url=url, verify=ssl.create_default_context(cafile=str(ca.cert)), timeout=10) as http:
            key = {"Authorization": "Bearer k"}
            answers = {"health": http.get("/health"), "ready, no key": http.get("/ready"),
                       "ready": http.get("/ready", headers=key),
                       "chat": http.post("/v1/chat/completions", headers=key, json={"messages": []})}
            return {name: (r.status_code, r.text) for name, r in answers.items()}

    out = _waiting(ApiKeys(["k"]), http_ssl_context(str(files.cert), str(files.key), None), requests)
    assert out["health"] == (200, "")
    assert out["ready, no key"][0] == 401 and "invalid_api_key" in out["ready, no key"][1]
    assert out["ready"][0] == 503 and message(out["ready"][1]) == f"not ready: {WAITING}"
    assert out["chat"][0] == 503 and message(out["chat"][1]) == "waiting for the control plane: unreachable (UNAVAILABLE: connection refused)"


def test_up_does_not_take_a_waiting_gateway_for_a_serving_one():
    from ttserve.up import _not_serving

    assert _waiting(ApiKeys([]), None, _not_serving) == f"not ready: {WAITING}"


def test_a_connection_queued_at_the_handover_reaches_the_next_server():
    """After the responder closes, a client connecting before the next server (uvicorn, here a
    stand-in) accepts waits in the socket's queue and is answered by that server."""
    async def scenario() -> tuple[int, int]:
        sock = bind_http_socket("127.0.0.1", 0)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/ready"
        responder = WaitingResponder(sock, ApiKeys([]))
        await responder.show(WAITING)
        before = (await asyncio.to_thread(get, url))[0]
        await responder.close()
        queued = asyncio.ensure_future(asyncio.to_thread(get, url))
        await asyncio.sleep(0.5)
        assert not queued.done()  # neither answered nor refused: queued

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, sock=sock)
        try:
            return before, (await asyncio.wait_for(queued, 10))[0]
        finally:
            server.close()

    assert asyncio.run(scenario()) == (503, 200)
