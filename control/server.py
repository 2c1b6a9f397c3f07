"""engine.proto service: client sessions, model and server info, health and reflection."""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

import grpc

import ttserve
from ttserve.grpc_service import start_server
from ttserve.protocol import PROTOCOL_VERSION
from ttserve.v1 import engine_pb2, engine_pb2_grpc

from .engine import Engine

log = logging.getLogger(__name__)


class EngineService(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def Session(self, requests: AsyncIterator[engine_pb2.ClientMessage],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.ServerMessage]:
        client_id, queue = self.engine.open_session()
        reader = asyncio.create_task(self._read(requests, client_id))
        try:
            while True:
                get = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait({get, reader}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    break  # the client closed its side
                yield get.result()
        finally:
            reader.cancel()
            self.engine.close_session(client_id)

    async def _read(self, requests: AsyncIterator[engine_pb2.ClientMessage], client_id: int) -> None:
        async for message in requests:
            if message.HasField("add"):
                self.engine.add(message.add, client_id)
            elif message.HasField("abort"):
                self.engine.abort(list(message.abort.request_ids))

    async def GetModelInfo(self, request: engine_pb2.ModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> engine_pb2.ModelInfo:
        engine = self.engine
        if engine.worker is None or engine.limits is None or engine.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the control plane is not ready: {engine.not_ready_reason}")
        w = engine.worker
        return engine_pb2.ModelInfo(
            model_path=w.model_path, architecture=w.architecture,
            max_model_len=engine.limits.max_model_len, vocab_size=w.vocab_size,
            block_size=w.block_size, num_blocks=w.num_blocks_per_lane,
            max_num_seqs=engine.config.max_num_seqs, num_lanes=1)

    async def GetServerInfo(self, request: engine_pb2.ServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> engine_pb2.ServerInfo:
        engine = self.engine
        info = engine_pb2.ServerInfo(protocol_version=PROTOCOL_VERSION, version=ttserve.__version__,
                                     ready=engine.ready)
        worker = engine.worker
        info.workers.add(address=engine.config.worker_address, ready=engine.ready,
                         backend=worker.backend if worker else "", mesh=worker.device if worker else "")
        return info


async def serve(engine: Engine, host: str, port: int) -> grpc.aio.Server:
    def register(server: grpc.aio.Server) -> None:
        engine_pb2_grpc.add_EngineServicer_to_server(EngineService(engine), server)

    return await start_server(host, port, register,
                              [engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name],
                              "control plane")
