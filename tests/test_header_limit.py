"""The bound on an HTTP request's head (gateway/header_limit.py), on a real uvicorn server with
the gateway's protocol class: a head past the limit is a 431 as it arrives, while bodies of any
size (within --max-request-bytes, another guard's) and heads within it pass."""
from __future__ import annotations

import asyncio
import socket
import time

import uvicorn

from stack import free_port
from ttserve.gateway.header_limit import protocol

LIMIT = 16 * 1024


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = f"{len(scope['headers'])} headers, {size} body bytes".encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def exchange(port: int, head: bytes, chunks: list[bytes] = (), timeout: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(head)
            for chunk in chunks:
                s.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused mid-send: the answer is already waiting
        reply = b""
        while True:
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            reply += data
            if b"\r\n\r\n" in reply and (b"431" in reply.split(b"\r\n", 1)[0] or reply.endswith(b"bytes")):
                break
    return reply


def slow_head(port: int, head: bytes, seconds: float) -> bytes:
    """Send `head` a byte at a time over `seconds` (all of it, then wait), and read the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=seconds + 10) as s:
        started = time.monotonic()
        try:
            for i, byte in enumerate(head):
                s.sendall(bytes([byte]))
                time.sleep(max(0.0, started + seconds * (i + 1) / len(head) - time.monotonic()))
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = b""
        while True:
            try:
                data = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not data:
                break
            reply += data
            if reply.endswith(b"body bytes") or b"408" in reply.split(b"\r\n", 1)[0] and b"\r\n\r\n" in reply \
                    and reply.split(b"\r\n\r\n", 1)[1]:
                break
    return reply


def test_a_head_past_the_limit_is_431_as_it_arrives_and_other_requests_pass():
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=protocol(LIMIT, 2.0),
                                           log_level="warning", lifespan="off"))

    async def scenario() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            ok = await asyncio.to_thread(exchange, port, b"GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n\r\n")
            assert ok.startswith(b"HTTP/1.1 200") and ok.endswith(b"2 headers, 0 body bytes"), ok
            # One header of 64 MiB in 64 KiB writes: refused after the first reads, not parsed whole.
            started = time.monotonic()
            big = await asyncio.to_thread(exchange, port, b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ",
                                          [b"a" * 65536] * 1024)
            assert big.startswith(b"HTTP/1.1 431"), big[:200]
            assert b"--max-header-bytes" in big and time.monotonic() - started < 5
            many = b"".join(b"X-%d: v\r\n" % i for i in range(5000))
            refused = await asyncio.to_thread(exchange, port, b"GET / HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
            assert refused.startswith(b"HTTP/1.1 431"), refused[:200]
            # A body is not a head: 1 MiB of it passes, sent with the head in one write.
            body = b"b" * (1 << 20)
            post = await asyncio.to_thread(
                exchange, port, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            assert post.startswith(b"HTTP/1.1 200") and post.endswith(b"1048576 body bytes"), post[:200]
            # Slowloris: a head still incomplete after the timeout, and a connection that sends
            # nothing, are closed with 408; a slow but complete head in time is served.
            late = await asyncio.to_thread(slow_head, port, b"GET / HTTP/1.1\r\nHost: x\r\nX-A: ", 8)
            assert late.startswith(b"HTTP/1.1 408") and b"took over 2 s" in late, late[:200]
            silent = await asyncio.to_thread(slow_head, port, b"", 8)
            assert silent.startswith(b"HTTP/1.1 408"), silent[:200]
            in_time = await asyncio.to_thread(slow_head, port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 1)
            assert in_time.startswith(b"HTTP/1.1 200"), in_time[:200]
        finally:
            server.should_exit = True
            await task

    asyncio.run(scenario())
