"""The protocol version check and address formatting (ttserve/protocol.py), on a real gRPC server
on loopback."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from ttserve.protocol import METADATA_KEY, PROTOCOL_VERSION, ProtocolVersionInterceptor, host_port


async def _call(method: str, version: str) -> grpc.aio.AioRpcError:
    """Calls `method` on a server that registers no method at all; the error it ends with."""
    server = grpc.aio.server(interceptors=[ProtocolVersionInterceptor()])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await channel.unary_unary(method)(b"", metadata=((METADATA_KEY, version),), timeout=10)
        return e.value
    finally:
        await server.stop(0)


def test_another_version_is_refused_for_a_method_the_server_lacks_naming_both_versions():
    error = asyncio.run(_call("/ttserve.v1.Engine/NoSuchMethod", "999"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "999" in error.details() and f"version {PROTOCOL_VERSION}" in error.details()


def test_our_version_still_gets_unimplemented_for_a_method_the_server_lacks():
    error = asyncio.run(_call("/ttserve.v1.Engine/NoSuchMethod", str(PROTOCOL_VERSION)))
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("host, expected", [
    ("127.0.0.1", "127.0.0.1:50051"),
    ("localhost", "localhost:50051"),
    ("::1", "[::1]:50051"),
    ("::", "[::]:50051"),
])
def test_host_port_brackets_ipv6_addresses(host, expected):
    assert host_port(host, 50051) == expected
