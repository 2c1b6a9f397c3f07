"""The operations endpoint of the control plane and the worker: `/metrics` (Prometheus text
format), `/health` (liveness) and `/ready` (readiness), over plain HTTP.

It runs on the service's own event loop, so a scrape reads the service's state between two
of its steps, never in the middle of one. One request per connection: scrapers and probes
open a connection per request anyway.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger(__name__)

# (ok, why): `why` says what is wrong when not ok, and is shown to the prober.
Probe = Callable[[], tuple[bool, str]]

MAX_REQUEST_HEAD = 16 << 10


@dataclass(slots=True)
class OpsEndpoints:
    registry: CollectorRegistry
    health: Probe
    ready: Probe


class OpsServer:
    def __init__(self, server: asyncio.Server, address: str) -> None:
        self._server = server
        self.address = address

    async def close(self) -> None:
        self._server.close()
        await self._server.wait_closed()


async def start_ops_server(host: str, port: int, endpoints: OpsEndpoints, what: str) -> OpsServer:
    """Listen on host:port; raises OSError naming the address when it cannot."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                ConnectionError):
            writer.close()
            return
        try:
            status, content_type, body = _respond(head, endpoints)
        except Exception as e:  # a collector or probe failed: say so instead of dropping the scrape
            log.exception("the operations endpoint failed")
            status, content_type, body = ("500 Internal Server Error", "text/plain",
                                          f"{type(e).__name__}: {e}\n".encode())
        method = head.split(b" ", 1)[0]
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
        if method != b"HEAD":
            writer.write(body)
        try:
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    try:
        server = await asyncio.start_server(handle, host, port, limit=MAX_REQUEST_HEAD)
    except OSError as e:
        raise OSError(e.errno, f"cannot listen on {host}:{port} for metrics and health: {e.strerror}") from None
    address = f"{host}:{port}"
    log.info("%s metrics and health on http://%s (/metrics, /health, /ready)", what, address)
    return OpsServer(server, address)


def _respond(head: bytes, endpoints: OpsEndpoints) -> tuple[str, str, bytes]:
    try:
        method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
    except ValueError:
        return "400 Bad Request", "text/plain", b"malformed request line\n"
    if method not in ("GET", "HEAD"):
        return "405 Method Not Allowed", "text/plain", b"only GET and HEAD\n"
    path = target.split("?", 1)[0]
    if path == "/metrics":
        return "200 OK", CONTENT_TYPE_LATEST, generate_latest(endpoints.registry)
    if path in ("/health", "/ready"):
        ok, why = (endpoints.health if path == "/health" else endpoints.ready)()
        body = json.dumps({"ok": ok} if ok else {"ok": False, "reason": why}).encode() + b"\n"
        return ("200 OK" if ok else "503 Service Unavailable"), "application/json", body
    return "404 Not Found", "text/plain", b"paths: /metrics, /health, /ready\n"
