"""The control plane's link to a worker bounds every wait: a worker that never finishes its
warmup is given up on after --warmup-timeout, with a message that says so. A real gRPC server
on a loopback port plays the worker that hangs."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from ttserve.control.worker_link import WorkerError, WorkerLink
from ttserve.v1 import device_pb2, device_pb2_grpc


class HangingWarmup(device_pb2_grpc.DeviceServicer):
    """Reports the start of its warmup, then never another word (a wedged device)."""

    async def Warmup(self, request, context):
        yield device_pb2.WarmupProgress(phase="load", completed=0, total=1, detail="weights")
        await asyncio.Event().wait()


def test_a_warmup_that_never_ends_fails_after_the_warmup_timeout():
    async def run() -> str:
        server = grpc.aio.server()
        device_pb2_grpc.add_DeviceServicer_to_server(HangingWarmup(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        link = WorkerLink(f"127.0.0.1:{port}")
        try:
            with pytest.raises(WorkerError) as failed:
                async for _ in link.warmup(1, 4, 256, 256, timeout=0.5):
                    pass
            return str(failed.value)
        finally:
            await link.close()
            await server.stop(0)

    message = asyncio.run(run())
    assert "did not finish warmup within --warmup-timeout 0.5 s" in message, message
