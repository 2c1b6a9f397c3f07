"""ControlClient (ttserve/control_client.py) when its session dies: it fails at once, not at its timeout."""
from __future__ import annotations

import socket
import time
from concurrent import futures

import grpc
import pytest

from ttserve.control_client import ControlClient
from ttserve.v1 import engine_pb2_grpc

TIMEOUT_S = 60  # collect()'s timeout; a failure must come long before it


class AbortingEngine(engine_pb2_grpc.EngineServicer):
    def Session(self, request_iterator, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is ready")


@pytest.fixture
def aborting_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    engine_pb2_grpc.add_EngineServicer_to_server(AbortingEngine(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_session_the_server_aborts_fails_collect_at_once_with_its_code_and_details(aborting_server):
    client = ControlClient(aborting_server)
    client.add("r1", [1, 2, 3], max_tokens=4)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="UNAVAILABLE: no worker is ready"):
        client.collect({"r1"}, timeout=TIMEOUT_S)
    with pytest.raises(ConnectionError):  # and every call after it
        client.next(timeout=TIMEOUT_S)
    assert time.monotonic() - start < 10
    client.close()


def test_no_server_fails_collect_at_once():
    client = ControlClient(closed_port())
    client.add("r1", [1, 2, 3], max_tokens=4)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="UNAVAILABLE"):
        client.collect({"r1"}, timeout=TIMEOUT_S)
    assert time.monotonic() - start < 10
    client.close()
