"""Keys, certificates and exposure rules at start-up: what each service refuses (exit status 2 with
one line naming the flag) before it serves, and the key middleware's open routes. Fast: no model
is loaded; the services that start are stopped at once."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import httpx
import pytest

from certs import CertificateAuthority
from stack import free_port
from ttserve.gateway.api_keys import ApiKeyConfigError, ApiKeyMiddleware, ApiKeys, load_api_keys
from ttserve.tls import TlsConfigError, is_loopback, load_tls


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    return CertificateAuthority(tmp_path_factory.mktemp("ca"), "unit-ca")


# ---- API keys -----------------------------------------------------------------------------------

def test_key_file_keys_join_the_flag_keys_and_the_variable_is_ignored_then(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# comment\nfile-key-1\n\n  file-key-2  \n")
    keys = load_api_keys(["flag-key"], str(path), environ={"VLLM_API_KEY": "env-key"})
    assert len(keys) == 3
    assert all(keys.accepts(k) for k in ("flag-key", "file-key-1", "file-key-2"))
    assert not keys.accepts("env-key")  # as vLLM: a flag takes precedence over VLLM_API_KEY


def test_the_variable_is_the_key_when_no_flag_gives_one():
    keys = load_api_keys(None, None, environ={"VLLM_API_KEY": "env-key"})
    assert keys.accepts("env-key") and not keys.accepts("env-ke") and not keys.accepts("env-key ")
    assert not load_api_keys(None, None, environ={})  # no key anywhere: the API is open


@pytest.mark.parametrize("content, words", [("# only a comment\n\n", "holds no key"), (None, "cannot read")])
def test_a_key_file_without_keys_is_refused(tmp_path, content, words):
    path = tmp_path / "keys"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ApiKeyConfigError, match=words):
        load_api_keys(None, str(path), environ={})


def test_an_empty_key_is_refused():
    with pytest.raises(ApiKeyConfigError, match="empty key"):
        load_api_keys([" "], None, environ={})


def test_no_key_is_accepted_by_keys_that_are_none():
    assert not ApiKeys(["k"]).accepts("") and ApiKeys(["k"]).accepts("k")


def _status(app, path: str, method: str = "GET", headers: dict | None = None) -> int:
    async def call() -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return (await client.request(method, path, headers=headers)).status_code
    return asyncio.run(call())


async def _ok_app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.parametrize("public_metrics", [False, True])
def test_metrics_is_open_only_when_the_operator_says_so(public_metrics):
    app = ApiKeyMiddleware(_ok_app, ApiKeys(["k"]), public_metrics=public_metrics)
    assert _status(app, "/health") == 200
    assert _status(app, "/metrics") == (200 if public_metrics else 401)
    assert _status(app, "/metrics/") == 401 and _status(app, "/healthz") == 401  # exact paths only
    assert _status(app, "/metrics", headers={"Authorization": "Bearer k"}) == 200


def test_a_cors_preflight_passes_but_a_bare_options_needs_the_key():
    app = ApiKeyMiddleware(_ok_app, ApiKeys(["k"]))
    preflight = {"Origin": "https://x", "Access-Control-Request-Method": "POST"}
    assert _status(app, "/v1/chat/completions", "OPTIONS", preflight) == 200
    assert _status(app, "/v1/chat/completions", "OPTIONS") == 401
    # Without Origin it is no preflight (CORS middleware would pass it on to the routes).
    assert _status(app, "/v1/chat/completions", "OPTIONS", {"Access-Control-Request-Method": "POST"}) == 401


# ---- certificates -------------------------------------------------------------------------------

def test_certificates_load_and_make_mutual_tls(ca):
    files = ca.issue("svc")
    tls = load_tls(str(files.cert), str(files.key), str(ca.cert))
    assert tls.mutual and tls.calls_tls and tls.server_credentials() and tls.channel_credentials()
    assert not load_tls(None, None, None).serves_tls


def test_tls_files_that_cannot_work_are_refused_naming_the_flag(ca, tmp_path):
    a, b = ca.issue("a"), ca.issue("b")
    (tmp_path / "not.pem").write_text("hello")
    cases = [((str(a.cert), None, None), "--ssl-certfile needs --ssl-keyfile"),
             ((None, str(a.key), None), "--ssl-keyfile needs --ssl-certfile"),
             ((str(tmp_path / "missing.crt"), str(a.key), None), "--ssl-certfile .*missing.crt: cannot read"),
             ((str(a.cert), str(b.key), None), "not a certificate and its matching key"),
             ((None, None, str(tmp_path / "not.pem")), "--ssl-ca-certs .*not a PEM file")]
    for flags, words in cases:
        with pytest.raises(TlsConfigError, match=words):
            load_tls(*flags)


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                            ("localhost", True), ("0.0.0.0", False), ("::", False),
                                            ("10.0.0.5", False), ("worker", False)])
def test_only_loopback_addresses_count_as_loopback(host, loopback):
    assert is_loopback(host) == loopback


# ---- start-up refusals, through the real commands ------------------------------------------------

def _refused(*argv: str) -> str:
    done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, f"exit {done.returncode}\n{done.stdout}{done.stderr}"
    return done.stdout + done.stderr


@pytest.mark.parametrize("service", ["ttserve.control", "ttserve.worker"])
def test_a_grpc_service_on_a_public_address_without_mutual_tls_is_refused(service, ca):
    files = ca.issue("svc")
    out = _refused(service, "--host", "0.0.0.0", "--port", str(free_port()), "--metrics-port", "0")
    assert "refusing to serve" in out and "--insecure" in out and "mutual TLS" in out
    # TLS without a CA is not enough either: the port would take any client.
    out = _refused(service, "--host", "0.0.0.0", "--port", str(free_port()), "--metrics-port", "0",
                   "--ssl-certfile", str(files.cert), "--ssl-keyfile", str(files.key))
    assert "refusing to serve" in out


def test_the_gateway_on_a_public_address_without_https_and_a_key_is_refused(ca):
    files = ca.issue("gw")
    out = _refused("ttserve.gateway", "--host", "0.0.0.0", "--port", str(free_port()))
    assert "refusing to serve the gateway's HTTP API on 0.0.0.0" in out and "--insecure" in out
    out = _refused("ttserve.gateway", "--host", "0.0.0.0", "--port", str(free_port()),
                   "--ssl-certfile", str(files.cert), "--ssl-keyfile", str(files.key))
    assert "an API key" in out


@pytest.mark.parametrize("service", ["ttserve.control", "ttserve.worker", "ttserve.gateway"])
def test_a_bad_certificate_path_stops_start_up_with_one_line(service, tmp_path):
    out = _refused(service, "--port", str(free_port()), *(() if service == "ttserve.gateway" else ("--metrics-port", "0")),
                   "--ssl-certfile", str(tmp_path / "nope.crt"), "--ssl-keyfile", str(tmp_path / "nope.key"))
    assert f"--ssl-certfile {tmp_path / 'nope.crt'}: cannot read it" in out and "Traceback" not in out


def test_a_missing_key_file_stops_the_gateway(tmp_path):
    out = _refused("ttserve.gateway", "--port", str(free_port()), "--api-key-file", str(tmp_path / "keys"))
    assert "--api-key-file" in out and "cannot read it" in out


def test_control_identity_without_mutual_tls_is_refused():
    out = _refused("ttserve.worker", "--port", str(free_port()), "--metrics-port", "0", "--control-identity", "c")
    assert "--control-identity needs mutual TLS" in out


def test_up_stops_with_status_2_when_its_certificate_cannot_be_read(tmp_path):
    ports = [str(free_port()) for _ in range(3)]
    out = _refused("ttserve.cli", "up", "--port", ports[0], "--control-port", ports[1], "--worker-port", ports[2],
                   "--control-metrics-port", "0", "--worker-metrics-port", "0", "--backend", "sim",
                   "--ssl-certfile", str(tmp_path / "nope.crt"), "--ssl-keyfile", str(tmp_path / "nope.key"))
    assert "refused its configuration" in out


def test_insecure_accepts_a_public_address_with_a_warning():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ttserve.control", "--host", "0.0.0.0", "--port", str(port),
                             "--metrics-port", "0", "--insecure", "--worker", f"127.0.0.1:{free_port()}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            lines.append(proc.stdout.readline())
            if "listening on" in lines[-1]:
                break
        text = "".join(lines)
        assert "listening on 0.0.0.0" in text and "(plaintext)" in text, text
        assert "WARNING" in text and "without mutual TLS" in text and "(--insecure)" in text, text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- request bodies -------------------------------------------------------------------------------

def test_a_body_over_the_limit_is_refused_with_413_before_the_app_reads_it_whole():
    from ttserve.gateway.body_limit import BodyLimitMiddleware

    read: list[int] = []

    async def reading_app(scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            read.append(len(body))
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    app = BodyLimitMiddleware(reading_app, limit=1000)

    async def post(content, headers=None) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/v1/chat/completions", content=content, headers=headers)

    assert asyncio.run(post(b"x" * 1000)).status_code == 200
    declared = asyncio.run(post(b"x" * 1001))  # Content-Length says it: refused unread
    assert declared.status_code == 413 and "1001 bytes" in declared.json()["error"]["message"]
    read.clear()

    async def chunks():  # no Content-Length: counted as it comes, refused once past the limit
        for _ in range(100):
            yield b"y" * 100

    chunked = asyncio.run(post(chunks()))
    assert chunked.status_code == 413 and "--max-request-bytes" in chunked.json()["error"]["message"]
    assert max(read, default=0) <= 1000  # the app never held more than the limit
