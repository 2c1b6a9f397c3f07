"""Issue 22's adversarial suite: attacks a running ttserve stack over its HTTP API and reports, for
every attack, what was expected and what came back, as a Markdown table.

    .venv/bin/python -m tests.adversarial --base-url http://127.0.0.1:8000 [--api-key KEY]
        [--second-api-key KEY2] [--rate-limited-key KEY3] [--media-host-ip IP]
        [--control-metrics-url http://127.0.0.1:9401] [--flood N] [--only WORD ...] [--list]

Exit status 0 when every attack met its expectation or was skipped (the stack lacks what it
needs: no API key given, not a vision model, ...), 1 when any did not, 2 when the stack cannot be
attacked at all (unreachable, not serving before the first attack).

After every attack, and once more at the end, the suite checks that the stack still serves: a
short chat completion must answer 200 with text. Any 5xx an attack provokes (but the 503s of an
overload), any request that gets no answer within --timeout, and a stack that no longer serves
fail that attack. With --control-metrics-url, the attacks that leave requests behind (aborted
streams, floods) also wait for the control plane to be idle again: no request running or waiting,
and ttserve_kv_cache_usage_perc back at its value before the attack (no leaked KV blocks).

Needs only the standard library and httpx; importable (`run(Config(...))` returns the outcomes,
`table(outcomes)` renders them), which is how tests/test_adversarial.py runs it in-process.
"""
from __future__ import annotations

import argparse
import base64
import http.server
import ipaddress
import json
import re
import socket
import ssl
import struct
import sys
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar
from urllib.parse import urlsplit

import httpx

DEFAULT_MAX_REQUEST_BYTES = 64 << 20   # the gateway's --max-request-bytes default
DEFAULT_IMAGE_LIMIT = 8                # the gateway's --limit-images-per-prompt default
MIB = 1 << 20


# ---- configuration and outcomes ----------------------------------------------------------------

@dataclass
class Config:
    base_url: str
    api_key: str | None = None
    second_api_key: str | None = None
    rate_limited_key: str | None = None
    media_host_ip: str = "127.0.0.1"
    allowed_media_networks: tuple[str, ...] = ()  # the gateway's --allowed-media-networks: fetching there is allowed
    control_metrics_url: str | None = None
    flood: int = 0                       # 0: the queue-flood attack is skipped
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    limit_images_per_prompt: int | None = None  # None: read from the gateway's refusal
    public_metrics: bool = False         # the gateway runs with --public-metrics
    slowloris_connections: int = 50
    slowloris_seconds: float = 10.0
    streams: int = 8
    rate_limit_attempts: int = 300
    settle_s: float = 10.0               # how long floods wait for every answer before aborting
    timeout: float = 60.0                # any single answer; longer is a hang
    stall_limit_s: float = 2.0           # a normal chat slower than this during an attack: the gateway stalled
    ca_certs: str | None = None          # HTTPS: the CA that signed the gateway's certificate
    only: tuple[str, ...] = ()           # run only attacks whose name contains one of these


@dataclass
class Outcome:
    name: str
    expected: str
    observed: str
    verdict: str  # "pass", "FAIL" or "skipped"
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.verdict != "FAIL"


class Skip(Exception):
    """The stack lacks what the attack needs; the message says what."""


class Failed(Exception):
    """The expectation did not hold; the message is what was observed."""


@dataclass
class Attack:
    name: str
    expected: str
    run: Callable[["Target"], str]
    allowed_5xx: frozenset[int] = frozenset()  # statuses >= 500 that are this attack's expectation


ATTACKS: list[Attack] = []


def attack(name: str, expected: str, allowed_5xx: Iterable[int] = ()) -> Callable:
    def register(fn: Callable[["Target"], str]) -> Callable[["Target"], str]:
        ATTACKS.append(Attack(name, expected, fn, frozenset(allowed_5xx)))
        return fn
    return register


# ---- the stack under attack --------------------------------------------------------------------

def _message(text: str) -> str:
    """The error message of an OpenAI-shaped (or FastAPI) error body, else the text."""
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if body.get("detail"):
            return str(body["detail"])
    return text.strip()


def short(text: str, limit: int = 110) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


@dataclass
class RawResponse:
    status: int | None            # None: the connection closed (or timed out) without a status line
    headers: dict[str, str]
    body: bytes
    seconds: float
    error: str = ""               # why there is no status

    def describe(self) -> str:
        if self.status is None:
            return f"no answer ({self.error})"
        return f"{self.status} '{short(_message(self.body.decode(errors='replace')), 90)}'"


class Target:
    """The stack: its gateway's HTTP API (httpx, and raw sockets for clients that lie)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        where = urlsplit(config.base_url.rstrip("/"))
        self.base_url = config.base_url.rstrip("/")
        self.https = where.scheme == "https"
        self.host = where.hostname or "127.0.0.1"
        self.port = where.port or (443 if self.https else 80)
        self.ssl_context: ssl.SSLContext | None = None
        if self.https:
            self.ssl_context = ssl.create_default_context(cafile=config.ca_certs)
        # A connection per request: a connection the gateway closed after an error (or its
        # keep-alive timeout) is no failure of the next request sent on it.
        self.http = httpx.Client(base_url=self.base_url, timeout=config.timeout,
                                 verify=self.ssl_context if self.ssl_context else True,
                                 limits=httpx.Limits(max_keepalive_connections=0))
        self.model = ""
        self.max_model_len = 0
        self.vision: bool | None = None   # decided by the first image attack
        self.vision_why = ""
        self.seen: list[tuple[str, int]] = []  # (what, status) of every answer during an attack

    # -- keys and requests ---------------------------------------------------------------
    def auth(self, key: str | None = "default") -> dict[str, str]:
        key = self.config.api_key if key == "default" else key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def record(self, what: str, status: int | None) -> None:
        if status is not None:
            self.seen.append((what, status))

    def request(self, method: str, path: str, *, key: str | None = "default", timeout: float | None = None,
                **kwargs) -> httpx.Response:
        headers = {**self.auth(key), **kwargs.pop("headers", {})}
        response = self.http.request(method, path, headers=headers, timeout=timeout or self.config.timeout,
                                     **kwargs)
        self.record(f"{method} {path}", response.status_code)
        return response

    def chat(self, extra: dict | None = None, *, messages: list | None = None, key: str | None = "default",
             max_tokens: int = 4, **kwargs) -> httpx.Response:
        body = {"model": self.model, "messages": messages or [{"role": "user", "content": "Say hello."}],
                "max_tokens": max_tokens, **(extra or {})}
        return self.request("POST", "/v1/chat/completions", key=key, json=body, **kwargs)

    def post_raw(self, path: str, content: bytes, content_type: str | None = "application/json",
                 key: str | None = "default") -> httpx.Response:
        headers = {"Content-Type": content_type} if content_type else {}
        return self.request("POST", path, key=key, content=content, headers=headers)

    # -- raw sockets -----------------------------------------------------------------------
    def connect(self, timeout: float | None = None) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=timeout or self.config.timeout)
        if self.ssl_context is not None:
            sock = self.ssl_context.wrap_socket(sock, server_hostname=self.host)
        return sock

    def head(self, method: str, path: str, headers: dict[str, str], key: str | None = "default") -> bytes:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        lines += [f"{k}: {v}" for k, v in {**self.auth(key), **headers}.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def read_response(self, sock: socket.socket, deadline: float, started: float | None = None,
                      until_data: bool = False) -> RawResponse:
        """Read one response (head, then a bounded body); `until_data`: for a 200 event stream, stop
        at its first `data:` line."""
        started = started or time.monotonic()
        buffer = b""
        try:
            while b"\r\n\r\n" not in buffer:
                sock.settimeout(max(0.05, deadline - time.monotonic()))
                data = sock.recv(65536)
                if not data:
                    return RawResponse(None, {}, buffer, time.monotonic() - started,
                                       "the connection closed before a status line")
                buffer += data
            head, body = buffer.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ")[1])
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers["content-length"]) if "content-length" in headers else None
            while len(body) < 1 * MIB:
                if length is not None and len(body) >= length:
                    break
                if until_data and status == 200 and b"data:" in body:
                    break
                if length is None and body.endswith(b"0\r\n\r\n"):
                    break
                sock.settimeout(max(0.05, deadline - time.monotonic()))
                data = sock.recv(65536)
                if not data:
                    break
                body += data
            if headers.get("transfer-encoding", "").lower() == "chunked":
                body = _unchunk(body)
            response = RawResponse(status, headers, body, time.monotonic() - started)
        except (TimeoutError, socket.timeout):
            return RawResponse(None, {}, buffer, time.monotonic() - started,
                               f"nothing within {deadline - started:.0f} s")
        except (ConnectionError, ssl.SSLError, OSError) as e:
            return RawResponse(None, {}, buffer, time.monotonic() - started, f"{type(e).__name__}: {e}")
        self.record("raw", response.status)
        return response

    # -- discovery and health ----------------------------------------------------------------
    def discover(self) -> None:
        response = self.request("GET", "/v1/models")
        if response.status_code != 200:
            raise RuntimeError(f"GET /v1/models answered {response.status_code}: {short(response.text, 300)}"
                               + ("" if self.config.api_key else " (does the stack need --api-key?)"))
        model = response.json()["data"][0]
        self.model = model["id"]
        self.max_model_len = int(model.get("max_model_len") or 2048)

    def alive(self) -> tuple[bool, str]:
        """A normal short chat completion: 200 with text."""
        started = time.monotonic()
        try:
            response = self.http.post("/v1/chat/completions", headers=self.auth(), timeout=self.config.timeout,
                                      json={"model": self.model, "max_tokens": 4, "ignore_eos": True,
                                            "messages": [{"role": "user", "content": "Say hello."}]})
        except httpx.TimeoutException as e:
            return False, f"a normal chat got no answer within {self.config.timeout:g} s ({type(e).__name__})"
        except httpx.HTTPError as e:
            return False, f"a normal chat failed: {type(e).__name__}: {e}"
        took = time.monotonic() - started
        if response.status_code != 200:
            return False, f"a normal chat answered {response.status_code}: {short(_message(response.text))}"
        choices = response.json().get("choices") or [{}]
        text = (choices[0].get("message") or {}).get("content")
        if not text:
            return False, f"a normal chat answered 200 without text: {short(response.text)}"
        return True, f"a normal chat answered 200 with text in {took:.2f} s"

    # -- the control plane's metrics ---------------------------------------------------------
    def control_samples(self) -> dict[tuple[str, tuple], float] | None:
        url = self.config.control_metrics_url
        if not url:
            return None
        text = httpx.get(f"{url.rstrip('/')}/metrics", timeout=10, verify=self.ssl_context or True).text
        samples = {}
        for line in text.splitlines():
            match = re.match(r"^([a-zA-Z_:][\w:]*)(\{(.*)\})? (\S+)$", line)
            if match and match.group(1) in ("ttserve_num_requests_running", "ttserve_num_requests_waiting",
                                            "ttserve_kv_cache_usage_perc"):
                labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', match.group(3) or "")))
                samples[(match.group(1), labels)] = float(match.group(4))
        return samples

    def idle_kv(self, timeout: float = 30) -> dict | None:
        """The KV usage per lane once nothing runs or waits (the baseline); None without metrics."""
        deadline = time.monotonic() + timeout
        while True:
            samples = self.control_samples()
            if samples is None:
                return None
            busy = sum(v for (name, _), v in samples.items() if name != "ttserve_kv_cache_usage_perc")
            if busy == 0 or time.monotonic() > deadline:
                return {labels: v for (name, labels), v in samples.items() if name == "ttserve_kv_cache_usage_perc"}
            time.sleep(0.25)

    def back_to_idle(self, baseline: dict | None, timeout: float = 30) -> str:
        """'' when the control plane is idle with the baseline's KV usage within `timeout`, or
        when there are no metrics to ask; else what is left."""
        if baseline is None:
            return ""
        deadline = time.monotonic() + timeout
        while True:
            samples = self.control_samples() or {}
            running = sum(v for (n, _), v in samples.items() if n == "ttserve_num_requests_running")
            waiting = sum(v for (n, _), v in samples.items() if n == "ttserve_num_requests_waiting")
            kv = {labels: v for (n, labels), v in samples.items() if n == "ttserve_kv_cache_usage_perc"}
            if running == 0 and waiting == 0 and all(kv.get(k, 0) <= v + 1e-9 for k, v in baseline.items()):
                return ""
            if time.monotonic() > deadline:
                return (f"after {timeout:g} s the control plane still has {running:g} running, {waiting:g} "
                        f"waiting, KV usage {_kv_text(kv)} (idle: {_kv_text(baseline)}): leaked")
            time.sleep(0.25)


def _kv_text(kv: dict) -> str:
    return ", ".join(f"{v:.4f}" for _, v in sorted(kv.items())) or "none"


def _unchunk(body: bytes) -> bytes:
    out, rest = b"", body
    while rest:
        size_line, sep, rest = rest.partition(b"\r\n")
        if not sep:
            return out + size_line
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            return body
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2:]
    return out


# ---- checks shared by the attacks ---------------------------------------------------------------

@dataclass
class Case:
    label: str
    send: Callable[["Target"], httpx.Response]
    statuses: tuple[int, ...] = (400,)
    says: tuple[str, ...] = ()  # words the refusal's message must contain (case-insensitive), any of them


def check_cases(target: Target, cases: list[Case]) -> str:
    """Send each case; observed: label -> status and message. Failed if any status or message is
    not the expected one."""
    parts, failed = [], False
    for case in cases:
        try:
            response = case.send(target)
        except httpx.TimeoutException:
            parts.append(f"{case.label}: ✗ no answer within {target.config.timeout:g} s")
            failed = True
            continue
        message = _message(response.text)
        good = response.status_code in case.statuses and (
            not case.says or any(w.lower() in message.lower() for w in case.says))
        failed |= not good
        parts.append(f"{case.label}: {'' if good else '✗ '}{response.status_code} '{short(message, 90)}'")
    observed = "; ".join(parts)
    if failed:
        raise Failed(observed)
    return observed


def json_body(model: str, **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def raw_json(target: Target, tail: bytes) -> bytes:
    """A chat body whose last field is given as raw JSON text (things json.dumps will not write)."""
    head = json.dumps({"model": target.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    return head[:-1].encode() + b", " + tail + b"}"


# ---- request bodies: size, structure, encoding -------------------------------------------------

@attack("body: declared Content-Length over --max-request-bytes",
        "413 at once, the body never sent")
def declared_huge_body(t: Target) -> str:
    declared = max(1 << 30, t.config.max_request_bytes + 1)
    with t.connect() as sock:
        started = time.monotonic()
        sock.sendall(t.head("POST", "/v1/chat/completions",
                            {"Content-Type": "application/json", "Content-Length": str(declared)}) + b"{")
        answer = t.read_response(sock, started + 10, started)
    observed = f"Content-Length {declared}, 1 byte sent: {answer.describe()} after {answer.seconds:.2f} s"
    if answer.status != 413:
        raise Failed(observed)
    return observed


@attack("body: chunked body growing past --max-request-bytes",
        "413 once the body passes the limit")
def chunked_huge_body(t: Target) -> str:
    limit = t.config.max_request_bytes
    chunk = b"%x\r\n" % MIB + b" " * MIB + b"\r\n"
    sent = 0
    with t.connect() as sock:
        started = time.monotonic()
        sock.sendall(t.head("POST", "/v1/chat/completions",
                            {"Content-Type": "application/json", "Transfer-Encoding": "chunked"}))
        try:
            while sent <= limit + 2 * MIB:
                sock.sendall(chunk)
                sent += MIB
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
            pass  # the gateway answered and closed: its answer is still to be read
        answer = t.read_response(sock, time.monotonic() + 30, started)
    observed = (f"{sent / MIB:.0f} MiB sent in 1 MiB chunks (limit {limit / MIB:.0f} MiB): {answer.describe()} "
                f"after {answer.seconds:.1f} s")
    if answer.status != 413:
        raise Failed(observed)
    return observed


@attack("json: 100k nested arrays / objects in a field",
        "400, never 500")
def deep_nesting(t: Target) -> str:
    depth = 100_000
    return check_cases(t, [
        Case("100k nested arrays as messages", lambda t: t.post_raw(
            "/v1/chat/completions", raw_json(t, b'"messages": ' + b"[" * depth + b"]" * depth)), (400, 422)),
        Case("100k nested objects in vllm_xargs", lambda t: t.post_raw(
            "/v1/chat/completions", raw_json(t, b'"vllm_xargs": ' + b'{"a":' * depth + b"1" + b"}" * depth)),
            (400, 422)),
        Case("900-deep schema (under the JSON parser's limit)", lambda t: t.post_raw(
            "/v1/chat/completions", raw_json(t, b'"response_format": {"type": "json_schema", "json_schema": '
                                                b'{"name": "x", "schema": ' + b'{"items": ' * 900 + b"{}"
                                                + b"}" * 900 + b"}}")), (400,)),
    ])


@attack("json: huge numbers and strings",
        "400 saying what is allowed, never 500")
def huge_values(t: Target) -> str:
    return check_cases(t, [
        Case("max_tokens of 5000 digits", lambda t: t.post_raw(
            "/v1/chat/completions", raw_json(t, b'"max_tokens": 1' + b"0" * 5000)), (400, 422)),
        Case("max_tokens 1e400 (an int)", lambda t: t.chat({"max_tokens": 10 ** 400}), (400,), ("max_tokens",)),
        Case("temperature 1e999 (parses as inf)", lambda t: t.post_raw(
            "/v1/chat/completions", raw_json(t, b'"temperature": 1e999')), (400,), ("temperature",)),
        Case("seed 10^30", lambda t: t.chat({"seed": 10 ** 30}), (400,), ("seed",)),
        Case("top_k 10^12", lambda t: t.chat({"top_k": 10 ** 12}), (400,), ("range", "top_k")),
        Case("8 MB of text", lambda t: t.chat(messages=[{"role": "user", "content": "hello " * 1_400_000}]),
             (400,), ("context length",)),
        Case("100k messages", lambda t: t.chat(messages=[{"role": "user", "content": "a"}] * 100_000),
             (400,), ("context length",)),
        Case("100k stop strings", lambda t: t.chat({"stop": [f"s{i}" for i in range(100_000)]}), (400,)),
        Case("100k allowed_token_ids", lambda t: t.chat({"allowed_token_ids": list(range(100_000))}),
             (400,), ("vocab",)),
    ])


@attack("body: invalid UTF-8, wrong content type, empty, not JSON",
        "4xx for each, never 500")
def bad_encodings(t: Target) -> str:
    four = tuple(range(400, 500))
    good = json.dumps(json_body(t.model)).encode()
    return check_cases(t, [
        Case("invalid UTF-8 in a string", lambda t: t.post_raw(
            "/v1/chat/completions", good.replace(b'"hi"', b'"hi \xc3\x28 \xed\xa0\x80 \xff"')), four),
        Case("UTF-16 body (valid JSON to Python)", lambda t: t.post_raw(
            "/v1/chat/completions", good.decode().encode("utf-16")), (200,) + four),
        Case("lone surrogate escape", lambda t: t.post_raw(
            "/v1/chat/completions", good.replace(b'"hi"', b'"hi \\ud800"')), four),
        Case("text/plain", lambda t: t.post_raw("/v1/chat/completions", good, "text/plain"), four),
        Case("form-urlencoded", lambda t: t.post_raw(
            "/v1/chat/completions", b"model=x&max_tokens=4", "application/x-www-form-urlencoded"), four),
        Case("no content type", lambda t: t.post_raw("/v1/chat/completions", good, None), (200,) + four),
        Case("empty body", lambda t: t.post_raw("/v1/chat/completions", b""), four),
        Case("not JSON", lambda t: t.post_raw("/v1/chat/completions", b"{this is not json"), four),
        Case("JSON null", lambda t: t.post_raw("/v1/chat/completions", b"null"), four),
        Case("JSON array", lambda t: t.post_raw("/v1/chat/completions", b"[]"), four),
    ])


@attack("http: conflicting and malformed framing (raw socket)",
        "4xx or the connection closed; never 5xx, never a hang")
def bad_framing(t: Target) -> str:
    body = json.dumps(json_body(t.model)).encode()
    cases = {
        "Content-Length and Transfer-Encoding": t.head("POST", "/v1/chat/completions", {
            "Content-Type": "application/json", "Content-Length": str(len(body)),
            "Transfer-Encoding": "chunked"}) + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n",
        "two Content-Lengths": t.head("POST", "/v1/chat/completions", {
            "Content-Type": "application/json", "Content-Length": str(len(body))})[:-2]
            + f"Content-Length: {len(body) + 5}\r\n\r\n".encode() + body,
        "negative Content-Length": t.head("POST", "/v1/chat/completions", {
            "Content-Type": "application/json", "Content-Length": "-1"}) + body,
        "Content-Length 12abc": t.head("POST", "/v1/chat/completions", {
            "Content-Type": "application/json", "Content-Length": "12abc"}) + body,
    }
    parts, failed = [], False
    for label, payload in cases.items():
        with t.connect() as sock:
            started = time.monotonic()
            try:
                sock.sendall(payload)
            except OSError:
                pass
            answer = t.read_response(sock, started + 15, started)
        hung = answer.status is None and "nothing within" in answer.error
        bad = hung or (answer.status is not None and not 400 <= answer.status < 500)
        failed |= bad
        parts.append(f"{label}: {'✗ ' if bad else ''}{answer.describe()}")
    observed = "; ".join(parts)
    if failed:
        raise Failed(observed)
    return observed


Result = TypeVar("Result")


def while_probing(t: Target, work: Callable[[], Result], every: float = 0.2) -> tuple[Result, str, bool]:
    """Run `work` on a thread while normal chats are sent one after another; returns its result,
    what the chats saw, and whether they were all served within --stall-limit."""
    result: dict[str, Result] = {}
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result["value"] = work()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    latencies, failures = [], []
    while thread.is_alive():
        started = time.monotonic()
        ok, what = t.alive()
        (latencies if ok else failures).append(time.monotonic() - started if ok else what)
        thread.join(every)
    if errors:
        raise errors[0]
    slowest = max(latencies, default=0.0)
    good = not failures and slowest <= t.config.stall_limit_s
    seen = (f"{len(latencies)}/{len(latencies) + len(failures)} normal chats served meanwhile"
            + (f", slowest {slowest:.2f} s" if latencies else "")
            + (f" ✗ over the {t.config.stall_limit_s:g} s stall limit" if slowest > t.config.stall_limit_s else "")
            + (f" ✗ {failures[0]}" if failures else ""))
    return result["value"], seen, good


@attack("http: oversized request headers",
        "431/400 (or the connection closed) for a header block far past any sane size; other clients not stalled")
def huge_headers(t: Target) -> str:
    def send(payload_parts: Iterable[bytes], finish: bytes) -> RawResponse:
        with t.connect() as sock:
            started = time.monotonic()
            try:
                for part in payload_parts:
                    sock.sendall(part)
                sock.sendall(finish)
            except OSError:
                pass  # refused and closed: the answer is still to be read
            return t.read_response(sock, time.monotonic() + t.config.timeout, started)

    def refused(answer: RawResponse) -> bool:
        if answer.status is None:
            return "nothing within" not in answer.error  # closed on us: refused; silence: a hang
        return 400 <= answer.status < 500

    parts, failed = [], False
    for label, head in (("a 1 MiB header", t.head("GET", "/v1/models", {"X-Big": "a" * MIB})),
                        ("10,000 headers", t.head("GET", "/v1/models", {f"X-H{i}": "v" for i in range(10_000)}))):
        answer = send([head], b"")
        failed |= not refused(answer)
        parts.append(f"{label}: {'' if refused(answer) else '✗ '}{answer.describe()}")
    big = 64 * MIB
    piece = b"a" * (64 << 10)
    head = t.head("GET", "/v1/models", {})[:-2] + b"X-Big: "
    answer, seen, good = while_probing(t, lambda: send([head] + [piece] * (big // len(piece)), b"\r\n\r\n"))
    failed |= not (refused(answer) and good)
    parts.append(f"one 64 MiB header in 64 KiB pieces: {'' if refused(answer) else '✗ '}"
                 f"{answer.describe()} after {answer.seconds:.1f} s; {seen}")
    observed = "; ".join(parts)
    if failed:
        raise Failed(observed)
    return observed


# ---- limits: each refusal says what is allowed --------------------------------------------------

@attack("limits: prompt longer than the context",
        "400 naming the model's maximum context length")
def prompt_too_long(t: Target) -> str:
    words = "hello " * (t.max_model_len + 50)
    return check_cases(t, [
        Case("chat", lambda t: t.chat(messages=[{"role": "user", "content": words}]), (400,), ("context length",)),
        Case("completion of token ids", lambda t: t.request("POST", "/v1/completions", json={
            "model": t.model, "prompt": [100] * (t.max_model_len + 1), "max_tokens": 1}), (400,),
            ("context length",)),
    ])


@attack("limits: max_tokens, n, logprobs beyond what is served",
        "400 each, saying the maximum")
def huge_counts(t: Target) -> str:
    return check_cases(t, [
        Case("max_tokens 10^9", lambda t: t.chat({"max_tokens": 10 ** 9}), (400,), ("max_model_len", "context")),
        Case("n 100000", lambda t: t.chat({"n": 100_000}), (400,), ("at most",)),
        Case("top_logprobs 1000", lambda t: t.chat({"logprobs": True, "top_logprobs": 1000}), (400,),
             ("max allowed", "at most", "between")),
        Case("completions logprobs 1000", lambda t: t.request("POST", "/v1/completions", json={
            "model": t.model, "prompt": "hi", "max_tokens": 2, "logprobs": 1000}), (400,),
            ("max allowed", "at most", "between")),
        Case("min_tokens 10^5", lambda t: t.chat({"min_tokens": 100_000}), (400,), ("min_tokens",)),
    ])


@attack("limits: temperature NaN, Infinity, negative",
        "400 each, saying temperature must be finite and >= 0")
def bad_temperature(t: Target) -> str:
    return check_cases(t, [
        Case("NaN", lambda t: t.post_raw("/v1/chat/completions", raw_json(t, b'"temperature": NaN')), (400,),
             ("temperature",)),
        Case("Infinity", lambda t: t.post_raw("/v1/chat/completions", raw_json(t, b'"temperature": Infinity')),
             (400,), ("temperature",)),
        Case("-1", lambda t: t.chat({"temperature": -1}), (400,), ("temperature",)),
        Case("top_p NaN", lambda t: t.post_raw("/v1/chat/completions", raw_json(t, b'"top_p": NaN')), (400,),
             ("top_p",)),
    ])


@attack("limits: priority other than 0",
        "400 saying priority 0 is what is served")
def priority(t: Target) -> str:
    return check_cases(t, [
        Case("priority 5", lambda t: t.chat({"priority": 5}), (400,), ("priority 0",)),
        Case("priority -2^63", lambda t: t.chat({"priority": -(2 ** 63)}), (400,), ("priority",)),
    ])


@attack("limits: unknown model name, out-of-vocabulary token ids",
        "400/404 naming the served model; 400 for token ids")
def unknown_model(t: Target) -> str:
    return check_cases(t, [
        Case("model gpt-4", lambda t: t.chat({"model": "gpt-4"}), (400, 404), (t.model,)),
        Case("model ../../etc/passwd", lambda t: t.chat({"model": "../../etc/passwd"}), (400, 404), (t.model,)),
        Case("token id 10^9", lambda t: t.request("POST", "/v1/completions", json={
            "model": t.model, "prompt": [10 ** 9], "max_tokens": 1}), (400,), ("vocab",)),
        Case("token id -1", lambda t: t.request("POST", "/v1/completions", json={
            "model": t.model, "prompt": [-1], "max_tokens": 1}), (400,)),
    ])


# ---- structured outputs -----------------------------------------------------------------------

def bounded(label: str, extra: dict) -> Case:
    """A structured-output request that may be refused (400) or answered (200) within the timeout."""
    return Case(label, lambda t: t.chat(extra, max_tokens=8), (200, 400))


@attack("structured output: catastrophic regexes, many choices, ambiguous grammars",
        "400 or a bounded 200 each, the stack still serving")
def pathological_regex(t: Target) -> str:
    return check_cases(t, [
        bounded("(a+)+$", {"structured_outputs": {"regex": "(a+)+$"}}),
        bounded("((a|aa)*b)x50", {"structured_outputs": {"regex": "(a|aa)*b" * 50}}),
        bounded("(.*a){30}", {"structured_outputs": {"regex": "(.*a){30}"}}),
        bounded("nested {1,100}^4", {"structured_outputs": {"regex": "((((a{1,100}){1,100}){1,100}){1,100})"}}),
        bounded("[a-z]{1,1000}{1,1000}", {"structured_outputs": {"regex": "[a-z]{1,1000}{1,1000}"}}),
        bounded("3000 choices", {"structured_outputs": {"choice": [f"c{i}" for i in range(3000)]}}),
        bounded("left-recursive grammar", {"structured_outputs": {"grammar": "start: s\ns: s s | s \"a\" | \"a\""}}),
    ])


@attack("structured output: pathological JSON schemas",
        "400 or a bounded 200 each (never 500), the stack still serving")
def pathological_schema(t: Target) -> str:
    def schema(body: dict) -> dict:
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": body}}}

    return check_cases(t, [
        bounded("10k required properties", schema({
            "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)},
            "required": [f"p{i}" for i in range(10_000)]})),
        bounded("recursive $ref, required (no finite instance)", schema({
            "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
            "$ref": "#/$defs/n"})),
        bounded("$ref cycle a -> b -> a", schema({
            "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})),
        bounded("$ref to nowhere", schema({"$ref": "#/$defs/missing"})),
        bounded("remote $ref", schema({"$ref": f"http://{t.config.media_host_ip}:9/schema.json"})),
        bounded("pattern (a+)+$ in a string", schema({"type": "string", "pattern": "(a+)+$"})),
    ])


@attack("structured output: 100k choices while others are served",
        "400 or a bounded 200 (never 500); other clients not stalled meanwhile")
def huge_choice(t: Target) -> str:
    choices = [f"choice-{i}" for i in range(100_000)]
    response, seen, good = while_probing(t, lambda: t.chat({"structured_outputs": {"choice": choices}}, max_tokens=8))
    status = response.status_code
    observed = (f"{'' if status in (200, 400) else '✗ '}{status} '{short(_message(response.text), 100)}' "
                f"after {response.elapsed.total_seconds():.1f} s; {seen}")
    if status not in (200, 400) or not good:
        raise Failed(observed)
    return observed


# ---- slow and vanishing clients --------------------------------------------------------------

@attack("slowloris: many connections sending headers (and bodies) at 1 byte/s",
        "other clients still served meanwhile")
def slowloris(t: Target) -> str:
    count, seconds = t.config.slowloris_connections, t.config.slowloris_seconds
    body = json.dumps(json_body(t.model)).encode()
    payloads = []
    for i in range(count):
        if i % 2 == 0:  # headers that never end
            payloads.append(t.head("POST", "/v1/chat/completions", {"Content-Type": "application/json"})[:-2]
                            + b"X-Slow: " + b"a" * 4096)
        else:  # a complete head, then the body byte by byte
            payloads.append(t.head("POST", "/v1/chat/completions", {"Content-Type": "application/json",
                                                                     "Content-Length": str(len(body))}) + body)
    socks, sent = [], []
    for i, payload in enumerate(payloads):
        sock = t.connect()
        sock.setblocking(False)
        socks.append(sock)
        if i % 2 == 1:
            head_end = payload.index(b"\r\n\r\n") + 4
            _send_all_nonblocking(sock, payload[:head_end])
            sent.append(head_end)
        else:
            sent.append(0)
    served, latencies, failures = 0, [], []
    closed = [False] * count
    started = time.monotonic()
    next_byte = started
    probes = 0
    while time.monotonic() - started < seconds:
        if time.monotonic() >= next_byte:
            for i, sock in enumerate(socks):
                if closed[i] or sent[i] >= len(payloads[i]) - 1:
                    continue
                try:
                    sock.send(payloads[i][sent[i]:sent[i] + 1])
                    sent[i] += 1
                except (BlockingIOError, ssl.SSLWantWriteError):
                    pass
                except OSError:
                    closed[i] = True
            next_byte += 1.0
        probe_started = time.monotonic()
        ok, what = t.alive()
        probes += 1
        if ok:
            served += 1
            latencies.append(time.monotonic() - probe_started)
        else:
            failures.append(what)
        time.sleep(max(0.0, min(0.5, next_byte - time.monotonic())))
    for i, sock in enumerate(socks):
        if not closed[i]:
            try:
                if sock.recv(1) == b"":
                    closed[i] = True
            except (BlockingIOError, ssl.SSLWantReadError):
                pass
            except OSError:
                closed[i] = True
        sock.close()
    observed = (f"{count} connections ({count - count // 2} slow headers, {count // 2} slow bodies) for "
                f"{seconds:g} s: {served}/{probes} normal chats served meanwhile"
                + (f" (slowest {max(latencies):.2f} s)" if latencies else "")
                + f"; the gateway closed {sum(closed)} of the slow connections")
    if failures:
        raise Failed(observed + f"; ✗ {failures[0]}")
    if latencies and max(latencies) > t.config.stall_limit_s:
        raise Failed(observed + f"; ✗ over the {t.config.stall_limit_s:g} s stall limit")
    return observed


def _send_all_nonblocking(sock: socket.socket, data: bytes, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while data:
        try:
            data = data[sock.send(data):]
        except (BlockingIOError, ssl.SSLWantWriteError):
            if time.monotonic() > deadline:
                raise TimeoutError("send blocked")
            time.sleep(0.01)


class Stream:
    """One streamed chat over a raw socket, read up to its status and first event on a thread of
    its own; `close` disconnects it whatever it is doing (the client vanishing)."""

    def __init__(self, target: Target, key: str | None, max_tokens: int, label: str = "") -> None:
        self.target, self.key, self.label = target, key, label
        self.body = json.dumps({"model": target.model, "stream": True, "max_tokens": max_tokens,
                                "ignore_eos": True, "messages": [{"role": "user", "content": "Tell a long story."}]
                                }).encode()
        self.answer: RawResponse | None = None
        self.sock: socket.socket | None = None
        self.error = ""
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Stream":
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            self.sock = self.target.connect()
            started = time.monotonic()
            self.sock.sendall(self.target.head("POST", "/v1/chat/completions", {
                "Content-Type": "application/json", "Content-Length": str(len(self.body))}, key=self.key) + self.body)
            # Long enough for a queued request to wait its turn; close() ends the wait sooner.
            self.answer = self.target.read_response(self.sock, started + 3600, started, until_data=True)
        except OSError as e:
            self.error = f"{type(e).__name__}: {e}"

    def kind(self) -> str:
        """'streaming', '503', '429', 'status NNN', 'no answer yet', or 'error: ...'."""
        if self.error:
            return f"error: {self.error}"
        if self.answer is None:
            return "no answer yet"
        if self.answer.status is None:
            return f"closed: {self.answer.error}"
        if self.answer.status == 200:
            return "streaming" if b"data:" in self.answer.body else "200 without an event"
        return str(self.answer.status) if self.answer.status in (429, 503) else f"status {self.answer.status}"

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()
        self.thread.join(5)


def open_streams(target: Target, count: int, key: str | None, max_tokens: int, settle: float) -> list[Stream]:
    """`count` streams started at once; returns once each has an answer or `settle` s have passed."""
    streams = [Stream(target, key, max_tokens).start() for _ in range(count)]
    deadline = time.monotonic() + settle
    for stream in streams:
        stream.thread.join(max(0.0, deadline - time.monotonic()))
    return streams


def tally(streams: list[Stream]) -> Counter:
    return Counter(s.kind() for s in streams)


def describe_tally(counts: Counter) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in counts.most_common())


def close_all(streams: list[Stream]) -> None:
    for stream in streams:
        stream.close()


def long_max_tokens(t: Target) -> int:
    return max(16, min(t.max_model_len - 128, 2048))


@attack("streams: many concurrent streams, the clients vanish mid-stream",
        "fresh requests still served; no request left running and no KV block leaked", allowed_5xx=(503,))
def abort_streams(t: Target) -> str:
    baseline = t.idle_kv()
    streams = open_streams(t, t.config.streams, "default", long_max_tokens(t), t.config.settle_s)
    counts = tally(streams)
    close_all(streams)
    observed = f"{t.config.streams} streams of {long_max_tokens(t)} tokens: {describe_tally(counts)}; all disconnected"
    bad = [k for k in counts if k not in ("streaming", "no answer yet", "503")]
    leaked = t.back_to_idle(baseline)
    observed += "; " + (leaked or ("control plane idle again, KV usage back to " + _kv_text(baseline)
                                   if baseline is not None else "no --control-metrics-url: KV not checked"))
    if bad or leaked or "streaming" not in counts:
        raise Failed(observed + ("; ✗ no stream started" if "streaming" not in counts else ""))
    return observed


@attack("flood: more concurrent long requests than the queue holds, then abort them",
        "503 with Retry-After for the overflow (or all admitted), never 500 or a hang; no KV leaked",
        allowed_5xx=(503,))
def queue_flood(t: Target) -> str:
    if t.config.flood <= 0:
        raise Skip("needs --flood N")
    baseline = t.idle_kv()
    streams = open_streams(t, t.config.flood, "default", long_max_tokens(t), t.config.settle_s)
    counts = tally(streams)
    refused = [s for s in streams if s.kind() == "503"]
    no_retry_after = [s for s in refused if "retry-after" not in s.answer.headers]
    close_all(streams)
    observed = f"{t.config.flood} at once: {describe_tally(counts)}"
    if refused:
        observed += f"; Retry-After on {len(refused) - len(no_retry_after)}/{len(refused)} 503s " \
                    f"('{short(_message(refused[0].answer.body.decode(errors='replace')), 70)}')"
    else:
        observed += "; none refused (the queue holds them all)"
    leaked = t.back_to_idle(baseline)
    observed += "; aborted: " + (leaked or ("control plane idle, KV back to " + _kv_text(baseline)
                                            if baseline is not None else "KV not checked (no metrics URL)"))
    bad = [k for k in counts if k not in ("streaming", "no answer yet", "503")]
    if bad or no_retry_after or leaked:
        raise Failed(observed)
    return observed


# ---- keys ---------------------------------------------------------------------------------------

PROTECTED = [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
             ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"), ("GET", "/docs"),
             ("GET", "/openapi.json"), ("GET", "/ready"), ("GET", "/version"), ("POST", "/invocations"),
             ("GET", "/no-such-path"), ("GET", "/v1/no-such-path")]


@attack("auth: no key / wrong key on every protected route",
        "401 invalid_api_key on /v1/*, /tokenize, /metrics, /docs, /openapi.json, unknown paths")
def wrong_keys(t: Target) -> str:
    if not t.config.api_key:
        raise Skip("needs --api-key (the stack's key)")
    credentials = {"no key": None, "wrong key": "Bearer wrong-key", "Basic scheme": f"Basic {t.config.api_key}",
                   "key + 1 char": f"Bearer {t.config.api_key}x", "key in the query": None}
    let_through, checked = [], 0
    for label, authorization in credentials.items():
        for method, path in PROTECTED:
            if path == "/metrics" and t.config.public_metrics:
                continue
            target_path = f"{path}?api_key={t.config.api_key}" if label == "key in the query" else path
            headers = {"Authorization": authorization} if authorization else {}
            response = t.request(method, target_path, key=None, headers=headers,
                                 **({"json": {}} if method == "POST" else {}))
            checked += 1
            if response.status_code != 401 or '"invalid_api_key"' not in response.text:
                let_through.append(f"{label} {method} {path} -> {response.status_code}")
    observed = f"{checked} requests ({len(credentials)} kinds of credential x {len(PROTECTED)} routes): " + (
        f"✗ not 401: {'; '.join(let_through[:6])}" if let_through else "all 401 invalid_api_key")
    if let_through:
        raise Failed(observed)
    return observed


@attack("auth: OPTIONS without Origin, path tricks, /health",
        "401 for OPTIONS with Access-Control-Request-Method but no Origin and for every path trick; /health 200")
def auth_edges(t: Target) -> str:
    if not t.config.api_key:
        raise Skip("needs --api-key (the stack's key)")
    parts, failed = [], False

    def expect(label: str, answer: RawResponse | httpx.Response, wanted: Callable[[int | None], bool]) -> None:
        nonlocal failed
        status = answer.status if isinstance(answer, RawResponse) else answer.status_code
        good = wanted(status)
        failed |= not good
        parts.append(f"{label}: {'' if good else '✗ '}{status}")

    expect("OPTIONS + ACRM, no Origin", t.request("OPTIONS", "/v1/chat/completions", key=None,
                                                  headers={"Access-Control-Request-Method": "POST"}),
           lambda s: s == 401)
    expect("OPTIONS, nothing", t.request("OPTIONS", "/v1/models", key=None), lambda s: s == 401)
    preflight = t.request("OPTIONS", "/v1/chat/completions", key=None, headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    expect("CORS preflight (no key, passes by design)", preflight, lambda s: s is not None and s < 500)
    for path in ("/health/../v1/models", "//v1/models", "/v1/models/", "/%2Fv1/models", "/HEALTH", "/health/x",
                 "/v1/./models", "/health%00"):
        with t.connect() as sock:
            started = time.monotonic()
            sock.sendall(t.head("GET", path, {}, key=None))
            answer = t.read_response(sock, started + t.config.timeout, started)
        expect(f"GET {path}", answer, lambda s: s in (400, 401, 404) and s != 200)
    with t.connect() as sock:
        started = time.monotonic()
        sock.sendall(t.head("POST", "/v1/chat/completions", {"Content-Type": "application/json",
                                                             "Content-Length": str(1 << 30)}, key=None))
        answer = t.read_response(sock, started + 10, started)
    expect(f"1 GiB body without a key (answered in {answer.seconds:.2f} s)", answer, lambda s: s == 401)
    expect("/health, no key", t.request("GET", "/health", key=None), lambda s: s == 200)
    observed = "; ".join(parts)
    if failed:
        raise Failed(observed)
    return observed


@attack("rate limit: one key over its rate",
        "429 with Retry-After for the limited key while --api-key's key is still served", allowed_5xx=(503,))
def rate_limit(t: Target) -> str:
    key = t.config.rate_limited_key
    if not key:
        raise Skip("needs --rate-limited-key")
    attempts = t.config.rate_limit_attempts
    lock, results = threading.Lock(), []
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            with lock:
                if len(results) >= attempts:
                    return
            try:
                response = t.chat(key=key, max_tokens=1)
                entry = (response.status_code, response.headers.get("retry-after"), _message(response.text))
            except httpx.HTTPError as e:
                entry = (None, None, f"{type(e).__name__}")
            with lock:
                results.append(entry)
            if entry[0] == 429:
                stop.set()

    started = time.monotonic()
    threads = [threading.Thread(target=hammer, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(t.config.timeout * 2)
    took = time.monotonic() - started
    statuses = Counter(status for status, _, _ in results)
    limited = next((r for r in results if r[0] == 429), None)
    observed = f"{len(results)} requests in {took:.1f} s with the limited key: " + \
               ", ".join(f"{n}x {s}" for s, n in statuses.most_common())
    if limited is None:
        raise Failed(observed + f"; ✗ no 429 after {len(results)} requests: no rate limit on this key")
    observed += f"; 429 Retry-After {limited[1]!r} '{short(limited[2], 60)}'"
    if t.config.api_key and t.config.api_key != key:
        other = t.chat(max_tokens=1)
        observed += f"; --api-key's key right after: {other.status_code}"
        if other.status_code != 200:
            raise Failed(observed)
    if limited[1] is None:
        raise Failed(observed + "; ✗ no Retry-After")
    return observed


@attack("tenant share: one key floods the queue, the other key is still admitted",
        "the second key's request is admitted (not 503/429) while the first key's overflow is refused",
        allowed_5xx=(503,))
def tenant_share(t: Target) -> str:
    if not (t.config.api_key and t.config.second_api_key):
        raise Skip("needs --api-key and --second-api-key")
    flood = t.config.flood or 64
    baseline = t.idle_kv()
    streams = open_streams(t, flood, "default", long_max_tokens(t), t.config.settle_s)
    counts = tally(streams)
    other = Stream(t, t.config.second_api_key, long_max_tokens(t)).start()
    other.thread.join(t.config.settle_s)
    verdict = other.kind()
    close_all(streams + [other])
    observed = f"key 1 sent {flood}: {describe_tally(counts)}; then key 2: {verdict}"
    if verdict in ("503", "429"):
        observed += f" '{short(_message(other.answer.body.decode(errors='replace')), 70)}'"
    leaked = t.back_to_idle(baseline)
    if leaked:
        raise Failed(observed + "; " + leaked)
    if not any(kind in ("503", "429") for kind in counts):
        raise Skip(f"key 1's flood of {flood} was all admitted: the queue was never full (give a larger --flood); "
                   + observed)
    if verdict not in ("streaming", "no answer yet"):
        raise Failed(observed + "; ✗ key 2 refused while key 1 floods: no per-tenant queue share")
    return observed


# ---- images -------------------------------------------------------------------------------------

def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(width: int, height: int, rgb: bool = True) -> bytes:
    """A small valid PNG with structure (8-bit RGB or greyscale)."""
    channels = 3 if rgb else 1
    raw = b"".join(b"\0" + bytes((x * 7 + y * 13) % 256 for x in range(width * channels)) for y in range(height))
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2 if rgb else 0, 0, 0, 0))
            + _png_chunk(b"IDAT", zlib.compress(raw)) + _png_chunk(b"IEND", b""))


def bomb_png(side: int = 13_000) -> bytes:
    """A valid all-black 8-bit greyscale PNG of side x side pixels: 13,000 is 169 MP in ~170 KB,
    which decodes to ~500 MB of RGB. Compressed row by row, so it costs no such memory here."""
    packer, row, parts = zlib.compressobj(9), b"\0" * (side + 1), []
    for _ in range(side):
        parts.append(packer.compress(row))
    parts.append(packer.flush())
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0))
            + _png_chunk(b"IDAT", b"".join(parts)) + _png_chunk(b"IEND", b""))


def data_url(payload: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(payload).decode()


def ask_images(t: Target, urls: list[str]) -> httpx.Response:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": "What is it?"}]
    return t.chat(messages=[{"role": "user", "content": content}], max_tokens=1)


def need_vision(t: Target) -> None:
    if t.vision is None:
        response = ask_images(t, [data_url(png(56, 56))])
        t.vision = response.status_code == 200
        t.vision_why = f"{response.status_code} '{short(_message(response.text), 80)}'"
    if not t.vision:
        raise Skip(f"the served model takes no images (a 56x56 PNG: {t.vision_why})")


@attack("images: decompression bomb (13000x13000 PNG, ~170 KB)",
        "400 before decoding, naming the pixel limit")
def image_bomb(t: Target) -> str:
    need_vision(t)
    bomb = bomb_png()
    response = ask_images(t, [data_url(bomb)])
    observed = f"{len(bomb) // 1024} KB PNG: {response.status_code} '{short(_message(response.text), 100)}'"
    if response.status_code != 400:
        raise Failed(observed)
    return observed


@attack("images: more images than --limit-images-per-prompt",
        "400 saying how many are allowed")
def too_many_images(t: Target) -> str:
    need_vision(t)
    limit = t.config.limit_images_per_prompt or DEFAULT_IMAGE_LIMIT
    if t.config.limit_images_per_prompt is None:  # learn the limit from a refusal, if it is lower
        probe = ask_images(t, [data_url(png(56, 56))] * (DEFAULT_IMAGE_LIMIT + 1))
        found = re.search(r"At most (\d+) image", _message(probe.text))
        limit = int(found.group(1)) if found else limit
    images = [data_url(png(56, 56))] * (limit + 1)
    response = ask_images(t, images)
    observed = f"{limit + 1} images (limit {limit}): {response.status_code} '{short(_message(response.text), 90)}'"
    if response.status_code != 400 or "at most" not in response.text.lower():
        raise Failed(observed)
    return observed


@attack("images: payloads that are not images",
        "400 each, never 500")
def not_images(t: Target) -> str:
    need_vision(t)
    return check_cases(t, [
        Case("text as image/png", lambda t: ask_images(t, [data_url(b"this is not a png")])),
        Case("truncated PNG", lambda t: ask_images(t, [data_url(png(56, 56)[:60])])),
        Case("HTML as image/png", lambda t: ask_images(t, [data_url(b"<html><body>hi</body></html>")])),
        Case("SVG", lambda t: ask_images(t, [data_url(b'<svg xmlns="http://www.w3.org/2000/svg" width="9" '
                                                      b'height="9"/>', "image/svg+xml")])),
        Case("1x3000 PNG (aspect ratio)", lambda t: ask_images(t, [data_url(png(1, 3000, rgb=False))])),
        Case("data URL that is not base64", lambda t: ask_images(t, ["data:image/png;base64,!!!not base64!!!"])),
        Case("file:///etc/passwd", lambda t: ask_images(t, ["file:///etc/passwd"])),
        Case("image URL whose host refuses the connection", lambda t: ask_images(t, [closed_port_url(t)])),
    ])


def closed_port_url(t: Target) -> str:
    """An http URL on the media host at a port nothing listens on."""
    family = socket.AF_INET6 if ":" in t.config.media_host_ip else socket.AF_INET
    with socket.socket(family) as probe:
        probe.bind((t.config.media_host_ip, 0))
        port = probe.getsockname()[1]
    host = f"[{t.config.media_host_ip}]" if ":" in t.config.media_host_ip else t.config.media_host_ip
    return f"http://{host}:{port}/nothing-here.png"


class Recorder:
    """A tiny HTTP server on (ip, any port) that records every request; it serves a PNG, or with
    `redirect_to` answers 302 to that URL."""

    def __init__(self, ip: str, redirect_to: str | None = None) -> None:
        self.paths: list[str] = []
        recorder = self
        picture = png(56, 56)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                recorder.paths.append(self.path)
                if redirect_to:
                    self.send_response(302)
                    self.send_header("Location", redirect_to)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(picture)))
                self.end_headers()
                self.wfile.write(picture)

            def log_message(self, *args) -> None:
                pass

        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        server_class = type("Server", (http.server.ThreadingHTTPServer,), {"address_family": family})
        self.server = server_class((ip, 0), Handler)
        self.ip, self.port = ip, self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"http://{host}:{self.port}"

    def __enter__(self) -> "Recorder":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _other_address(ip: str) -> str:
    """An address other than `ip` to redirect to: 127.0.0.2 for a loopback media host."""
    address = ipaddress.ip_address(ip)
    if address.version == 4 and address.is_loopback:
        return "127.0.0.2" if ip != "127.0.0.2" else "127.0.0.3"
    return ip  # another port on the same address


@attack("images: URL of a private or loopback IP literal (SSRF)",
        "400, and no request reaches the address")
def image_private_address(t: Target) -> str:
    need_vision(t)
    ip = t.config.media_host_ip
    private = ipaddress.ip_address(ip)
    if not (private.is_private or private.is_loopback or private.is_link_local):
        raise Skip(f"--media-host-ip {ip} is neither private nor loopback")
    allowed = [ipaddress.ip_network(n) for n in t.config.allowed_media_networks]
    parts, failed = [], False
    # Two servers that record what reaches them: the media host, and another private address.
    with Recorder(ip) as media, Recorder(_other_address(ip)) as other:
        urls = [(media, f"{media.url}/direct.png", f"the media host {ip}"),
                (other, f"{other.url}/other.png", f"another address {other.ip}"),
                (media, f"http://{int(private)}:{media.port}/decimal.png" if private.version == 4 else None,
                 "the media host as a decimal"),
                (media, f"http://[::ffff:{ip}]:{media.port}/mapped.png" if private.version == 4 else None,
                 "the media host IPv4-mapped"),
                (None, "http://169.254.169.254/latest/meta-data/", "cloud metadata"),
                (None, "http://10.255.255.1/x.png", "10/8"),
                (None, f"http://[::1]:{media.port}/v6.png", "[::1]"),
                (None, f"http://0.0.0.0:{media.port}/zero.png", "0.0.0.0")]
        for server, url, label in urls:
            if url is None:
                continue
            host = urlsplit(url).hostname or ""
            try:
                address = ipaddress.ip_address(host)  # an IP literal as written (not its decimal form)
            except ValueError:
                address = None
            if address is not None and any(address in network for network in allowed):
                parts.append(f"{label}: not checked (in --allowed-media-networks)")
                continue
            before = len(server.paths) if server else 0
            response = ask_images(t, [url])
            reached = server is not None and len(server.paths) > before
            good = response.status_code == 400 and not reached
            failed |= not good
            parts.append(f"{label}: {'' if good else '✗ '}{response.status_code}"
                         f"{' REACHED' if reached else ''} '{short(_message(response.text), 70)}'")
    observed = "; ".join(parts)
    if failed:
        raise Failed(observed + " (no private-address guard on image URLs)")
    return observed


@attack("images: URL redirecting to another address",
        "400, and no request reaches the redirect's target")
def image_redirect(t: Target) -> str:
    need_vision(t)
    ip = t.config.media_host_ip
    with Recorder(_other_address(ip)) as target:
        with Recorder(ip, redirect_to=f"{target.url}/metadata") as media:
            response = ask_images(t, [f"{media.url}/redirect.png"])
    asked, reached = bool(media.paths), bool(target.paths)
    observed = (f"{media.url} -> 302 -> {target.url}: {response.status_code} '{short(_message(response.text), 80)}'; "
                f"media host asked: {'yes' if asked else 'no (refused before fetching)'}; "
                f"redirect target reached: {'YES' if reached else 'no'}")
    if response.status_code != 400 or reached:
        raise Failed(observed)
    return observed


# ---- the run ------------------------------------------------------------------------------------

def selected(config: Config) -> list[Attack]:
    if not config.only:
        return list(ATTACKS)
    return [a for a in ATTACKS if any(word.lower() in a.name.lower() for word in config.only)]


def run(config: Config, progress: Callable[[str], None] | None = None) -> list[Outcome]:
    """Every selected attack, each followed by a check that the stack still serves; a final row
    checks it once more. Raises RuntimeError when the stack cannot be attacked at all."""
    progress = progress or (lambda line: None)
    target = Target(config)
    target.discover()
    ok, what = target.alive()
    if not ok:
        raise RuntimeError(f"the stack does not serve before the first attack: {what}")
    progress(f"attacking {target.base_url} ({target.model}, max_model_len {target.max_model_len})")
    outcomes = []
    for item in selected(config):
        target.seen = []
        started = time.monotonic()
        try:
            observed, verdict = item.run(target), "pass"
        except Skip as e:
            observed, verdict = f"skipped: {e}", "skipped"
        except Failed as e:
            observed, verdict = str(e), "FAIL"
        except httpx.TimeoutException as e:
            observed, verdict = f"✗ no answer within {config.timeout:g} s (a hang): {type(e).__name__}", "FAIL"
        except Exception as e:  # noqa: BLE001 - an attack that breaks is reported, the rest still run
            observed, verdict = f"✗ the attack broke: {type(e).__name__}: {short(str(e), 200)}", "FAIL"
        server_errors = sorted({f"{what} -> {status}" for what, status in target.seen
                                if status >= 500 and status not in item.allowed_5xx})
        if server_errors and verdict != "skipped":
            observed, verdict = observed + f"; ✗ server error: {', '.join(server_errors[:3])}", "FAIL"
        ok, what = target.alive()
        if not ok:
            observed, verdict = observed + f"; ✗ afterwards: {what}", "FAIL"
        outcome = Outcome(item.name, item.expected, observed, verdict, time.monotonic() - started)
        outcomes.append(outcome)
        progress(f"{outcome.verdict:7} {outcome.seconds:5.1f} s  {outcome.name}")
    ok, what = target.alive()
    outcomes.append(Outcome("end: the stack still serves", "a normal chat answers 200 with text", what,
                            "pass" if ok else "FAIL"))
    target.http.close()
    return outcomes


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(outcomes: list[Outcome]) -> str:
    lines = ["| attack | expected | observed | pass |", "|---|---|---|---|"]
    lines += [f"| {_cell(o.name)} | {_cell(o.expected)} | {_cell(o.observed)} | {o.verdict} |" for o in outcomes]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> tuple[Config, bool]:
    parser = argparse.ArgumentParser(prog="python -m tests.adversarial", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=False, default="http://127.0.0.1:8000",
                        help="the gateway (default %(default)s)")
    parser.add_argument("--api-key", help="a key the gateway accepts (enables the auth attacks)")
    parser.add_argument("--second-api-key", help="another tenant's key (enables the tenant-share attack)")
    parser.add_argument("--rate-limited-key", help="a key with a rate limit (enables the rate-limit attack)")
    parser.add_argument("--media-host-ip", default="127.0.0.1",
                        help="address for the suite's own image and redirect servers (default %(default)s)")
    parser.add_argument("--allowed-media-networks", nargs="+", default=(), metavar="CIDR",
                        help="the gateway's --allowed-media-networks: private addresses there may be fetched")
    parser.add_argument("--control-metrics-url", help="the control plane's metrics server, e.g. "
                        "http://127.0.0.1:9401: checks no request or KV block is left after aborts")
    parser.add_argument("--flood", type=int, default=0, metavar="N",
                        help="fire N concurrent long requests (the queue-flood attack; also the tenant flood)")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="the gateway's --max-request-bytes (default %(default)d)")
    parser.add_argument("--limit-images-per-prompt", type=int, default=None,
                        help="the gateway's --limit-images-per-prompt (default: learnt from its refusal)")
    parser.add_argument("--public-metrics", action="store_true", help="the gateway serves /metrics without a key")
    parser.add_argument("--slowloris-connections", type=int, default=50)
    parser.add_argument("--slowloris-seconds", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams to abort (default %(default)d)")
    parser.add_argument("--rate-limit-attempts", type=int, default=300)
    parser.add_argument("--settle", type=float, default=10.0,
                        help="seconds a flood waits for its answers before aborting (default %(default)g)")
    parser.add_argument("--stall-limit", type=float, default=2.0,
                        help="seconds a normal chat may take while an attack runs (default %(default)g)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds any one answer may take before it counts as a hang (default %(default)g)")
    parser.add_argument("--ca-certs", help="for an https:// base URL: the CA of the gateway's certificate")
    parser.add_argument("--only", nargs="+", default=(), metavar="WORD", help="run the attacks whose name has WORD")
    parser.add_argument("--list", action="store_true", help="list the attacks and exit")
    args = parser.parse_args(argv)
    config = Config(base_url=args.base_url, api_key=args.api_key, second_api_key=args.second_api_key,
                    rate_limited_key=args.rate_limited_key, media_host_ip=args.media_host_ip,
                    allowed_media_networks=tuple(args.allowed_media_networks),
                    control_metrics_url=args.control_metrics_url, flood=args.flood,
                    max_request_bytes=args.max_request_bytes, limit_images_per_prompt=args.limit_images_per_prompt,
                    public_metrics=args.public_metrics, slowloris_connections=args.slowloris_connections,
                    slowloris_seconds=args.slowloris_seconds, streams=args.streams,
                    rate_limit_attempts=args.rate_limit_attempts, settle_s=args.settle, timeout=args.timeout,
                    stall_limit_s=args.stall_limit,
                    ca_certs=args.ca_certs, only=tuple(args.only))
    return config, args.list


def main(argv: list[str] | None = None) -> int:
    config, listing = parse_args(argv)
    if listing:
        for item in selected(config):
            print(f"{item.name}\n    expected: {item.expected}")
        return 0
    try:
        outcomes = run(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (RuntimeError, httpx.HTTPError, OSError) as e:
        print(f"adversarial: cannot attack {config.base_url}: {e}", file=sys.stderr)
        return 2
    print(table(outcomes))
    failed = [o.name for o in outcomes if not o.ok]
    print(f"\n{len(outcomes)} rows: {sum(o.verdict == 'pass' for o in outcomes)} passed, "
          f"{sum(o.verdict == 'skipped' for o in outcomes)} skipped, {len(failed)} failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
