"""A bound on an HTTP request's head (request line and headers), before any of it is parsed whole.

uvicorn parses HTTP/1.1 with httptools when it is installed (it is, with vLLM), and then applies
no limit to the head at all: vLLM's --h11-max-incomplete-event-size binds only the h11 parser.
httptools accumulates a header value piece by piece (quadratic in its length), so one client
sending a 64 MiB header froze the event loop for seconds, and four of 256 MiB took 1.2 GB that
stayed after they closed. `protocol(limit)` is uvicorn's own httptools protocol class with one
change: the bytes a request's head has taken are counted as they arrive (reads that end inside
it) and as the parser hands them over (a whole head in one read), and past `limit` the
connection gets 431 and is closed; the head is never held beyond `limit` plus one read. A head
that takes over HEAD_TIMEOUT_S to arrive (slowloris), or a connection that sends none, gets 408.

uvicorn takes the class as its `http` setting (uvicorn.Config(http=...)). Mirrors uvicorn 0.54's
protocols/http/httptools_impl.py (HttpToolsProtocol: data_received feeds the parser;
on_message_begin and on_headers_complete bracket a head); tests/test_header_limit.py fails if
those hooks change.
"""
from __future__ import annotations

import asyncio
import logging

DEFAULT_MAX_HEADER_BYTES = 64 * 1024  # --max-header-bytes: nginx's large_client_header_buffers is 4 x 8 KiB
# A head (or a new connection's first one) must arrive within this: a client sending a byte a
# second (slowloris) would otherwise hold its connection for ever (nginx's client_header_timeout
# is 60 s). Idle keep-alive connections between requests are uvicorn's --timeout-keep-alive.
HEAD_TIMEOUT_S = 30.0

log = logging.getLogger(__name__)

_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s")
_REFUSAL = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s")


def protocol(limit: int, head_timeout_s: float = HEAD_TIMEOUT_S) -> type[asyncio.Protocol] | str:
    """uvicorn's `http` setting for heads of at most `limit` bytes, each arriving within
    `head_timeout_s` of its first byte (or of the connection): the bounded httptools protocol, or
    "h11" (whose own limit, max_incomplete_event_size, the caller sets; it has no head timeout)
    where httptools is not installed."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "h11"

    class BoundedHeadProtocol(HttpToolsProtocol):
        _head_bytes = 0   # reads that ended inside the current head
        _parsed = 0       # its request line and headers, as the parser hands them over
        _in_head = True   # from the connection's first byte until a head is complete
        _over = False
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._start_head_timer()  # a connection that never sends a head is closed too

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_head_timer()
            super().connection_lost(exc)

        def _start_head_timer(self) -> None:
            self._stop_head_timer()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_timed_out)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self._in_head and not self.transport.is_closing():
                message = f"the request's headers took over {head_timeout_s:g} s to arrive".encode()
                self.transport.write(_TIMEOUT % (len(message), message))
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._in_head or self.transport.is_closing():
                return
            # The whole read belonged to a head that is still not complete.
            self._head_bytes += len(data)
            if self._head_bytes > limit:
                self._over = True
                self.send_400_response("")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes, self._parsed = True, 0, 0
            self._start_head_timer()

        def on_url(self, url: bytes) -> None:
            self._parsed += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._parsed += len(name) + len(value) + 4
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._stop_head_timer()
            if self._parsed > limit:  # a whole head within one read
                self._over = True
                # httptools turns a callback's exception into HttpParserError, which uvicorn
                # answers with send_400_response: the 431 below.
                raise ValueError("request head over the limit")
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            if not self._over:
                return super().send_400_response(msg)
            message = f"the request's headers passed {limit} bytes, this gateway's limit (--max-header-bytes)".encode()
            log.warning("refused a request head of over %d bytes from %s", limit,
                        "%s:%d" % self.client if self.client else "a client")
            self.transport.write(_REFUSAL % (len(message), message))
            self.transport.close()

    return BoundedHeadProtocol
