"""The gateway's HTTP port while it waits for the control plane (and then builds vLLM's app).

`/health` answers 200 (the process is alive; a liveness probe must not kill a gateway waiting
through a 30-minute warmup), `/ready` 503 with the reason, and every other route 503 with a JSON
error saying what the gateway waits for, under the served app's API-key rules (the same
`ApiKeyMiddleware`) and over HTTPS with the certificate it will serve with.

Handover invariant: the gateway has one listening socket (server.bind_http_socket), listening
from bind until exit. The responder accepts on a dup() of it; `close` stops accepting and closes
only the dup before vLLM's uvicorn starts on the original. Connections queued in between stay in
the kernel's one queue until uvicorn accepts them; one accepted here is answered here. None is
lost, and no request reaches vLLM's app before it is whole.

One request per connection (`Connection: close`): probes and retrying clients need no more.
Importing this module is cheap (no vLLM).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import logging
import shlex
import socket
import ssl
from typing import Any
from urllib.parse import unquote

from ttserve.gateway.api_keys import ApiKeyMiddleware, ApiKeys, Receive, Scope, Send
from ttserve.gateway.body_limit import content_length
from ttserve.gateway.readiness import service_unavailable

log = logging.getLogger("ttserve.gateway.waiting")

BACKLOG = 2048                # uvicorn's default, which vLLM's serve_http keeps
MAX_HEAD = 16 << 10
HEAD_TIMEOUT_S = 10.0
MAX_DISCARDED_BODY = 1 << 20  # read (and drop) a body this small, so closing sends no RST over the answer
RETRY_AFTER_S = 5


def http_ssl_context(certfile: str | None, keyfile: str | None, ca_certs: str | None,
                     vllm_args: str = "") -> ssl.SSLContext | None:
    """The TLS context uvicorn builds from vLLM's flags (uvicorn.config.create_ssl_context with
    serve_http's arguments), so a client sees the same server before and after the handover;
    None: plain HTTP."""
    if not (certfile and keyfile):
        return None
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE))
    cert_reqs = extra.parse_known_args(shlex.split(vllm_args or ""))[0].ssl_cert_reqs
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certfile, keyfile)
    context.verify_mode = ssl.VerifyMode(cert_reqs)
    if ca_certs:
        context.load_verify_locations(ca_certs)
    return context


def _scope(head: bytes) -> Scope | None:
    """The ASGI scope of a request head; None if it is not HTTP/1.x."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return None
    method, target, _ = parts
    headers = []
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if colon:
            headers.append((name.strip().lower().encode("latin-1"), value.strip().encode("latin-1")))
    return {"type": "http", "method": method.upper(), "path": unquote(target.split("?", 1)[0]),
            "root_path": "", "headers": headers}


# host:port and [IPv6]:port, as the waiting messages name the control planes (a list: "at A, B")
# and the workers.
_ADDRESS = re.compile(r",?\s*(?:at )?(?:\[[0-9A-Fa-f:.%]+\]|[A-Za-z0-9_.-]+):\d{1,5}\b")


def without_addresses(message: str) -> str:
    """`message` for an API client: the addresses of the services behind the gateway are the
    operator's (logs and the keyed /ready name them)."""
    return _ADDRESS.sub("", message)


class WaitingResponder:
    """Answers on `sock` (listening) from `show` until `close`; `message` says what the gateway
    is doing instead of serving, for a person to read."""

    def __init__(self, sock: socket.socket, api_keys: ApiKeys, *, public_metrics: bool = False,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.message = "starting"
        self._sock = sock
        self._ssl = ssl_context
        self._guarded = ApiKeyMiddleware(self._app, api_keys, public_metrics=public_metrics)
        self._server: asyncio.AbstractServer | None = None
        self._closed = False

    async def show(self, message: str) -> None:
        """Answer with `message` from now on; starts answering on the first call."""
        self.message = message
        if self._server is None and not self._closed:
            self._server = await asyncio.start_server(self._handle, sock=self._sock.dup(), backlog=BACKLOG,
                                                      limit=MAX_HEAD, ssl=self._ssl,
                                                      ssl_handshake_timeout=HEAD_TIMEOUT_S if self._ssl else None)

    async def close(self) -> None:
        """Stop accepting (the original socket stays open and listening). Connections already
        accepted finish on their own, each bounded by HEAD_TIMEOUT_S."""
        self._closed = True
        if self._server is not None:
            self._server.close()
            self._server = None
            await asyncio.sleep(0)  # uvloop closes the listening handle on the next iteration

    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/health":
            status, body = 200, b""
        else:
            # /ready is the operator's (it names addresses); a client's route reads no address.
            message = f"not ready: {self.message}" if scope["path"] == "/ready" else without_addresses(self.message)
            status, body = 503, json.dumps(service_unavailable(message)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 503:
            headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _respond(self, scope: Scope) -> bytes:
        """The whole HTTP response to one request, through the API-key middleware."""
        start: dict[str, Any] = {}
        body = bytearray()

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                body.extend(message.get("body", b""))

        await self._guarded(scope, receive, send)
        status = start.get("status", 500)
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}".encode()]
        lines += [name + b": " + value for name, value in start.get("headers", [])]
        lines.append(b"connection: close")
        return b"\r\n".join(lines) + b"\r\n\r\n" + (b"" if scope["method"] == "HEAD" else bytes(body))

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            scope = _scope(head)
            if scope is None:
                writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            else:
                length = max(0, content_length(scope) or 0)
                if length <= MAX_DISCARDED_BODY:
                    await asyncio.wait_for(reader.readexactly(length), HEAD_TIMEOUT_S)
                writer.write(await self._respond(scope))
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                ConnectionError, ssl.SSLError):
            pass
        except Exception:  # one connection's failure must not end the wait
            log.exception("answering a request while waiting failed")
        finally:
            writer.close()


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 503: "Service Unavailable"}
