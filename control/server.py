"""engine.proto service: client sessions, model and server info, health and reflection."""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

import grpc

import ttserve
from ttserve.grpc_service import GrpcService, start_server
from ttserve.protocol import PROTOCOL_VERSION
from ttserve.tls import PLAINTEXT, Tls
from ttserve.v1 import engine_pb2, engine_pb2_grpc

from .engine import Engine
from .wire import mm_inputs_problem, request_from_pb, session_message_to_pb

log = logging.getLogger(__name__)


class EngineService(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def Session(self, requests: AsyncIterator[engine_pb2.ClientMessage],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.ServerMessage]:
        if self.engine.draining:  # sessions already open go on; their new requests are refused
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the control plane is shutting down: "
                                "it admits no new sessions or requests; retry on another replica")
        client_id, queue = self.engine.open_session()
        reader = asyncio.create_task(self._read(requests, client_id))
        try:
            while True:
                get = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait({get, reader}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    break  # the client closed its side
                message = get.result()
                if message is None:
                    break  # the control plane is shutting down
                yield session_message_to_pb(message)
        finally:
            reader.cancel()
            self.engine.close_session(client_id)

    async def _read(self, requests: AsyncIterator[engine_pb2.ClientMessage], client_id: int) -> None:
        async for message in requests:
            if message.HasField("add"):
                add = message.add
                if self.engine.turned_away(add.request_id, add.tenant, add.ByteSize(), client_id):
                    continue  # refused before conversion: overload costs no more than this
                request, unsupported = request_from_pb(add, client_id)
                self.engine.admit(request, unsupported, mm_inputs_problem(add) if add.mm_inputs else None)
            elif message.HasField("abort"):
                self.engine.abort(list(message.abort.request_ids), client_id)

    async def GetModelInfo(self, request: engine_pb2.ModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> engine_pb2.ModelInfo:
        engine = self.engine
        ready = [g for g in engine.workers.values() if g.ready]
        if not ready or engine.serving is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the control plane is not ready: {engine.not_ready_reason}")
        first = ready[0].description
        lanes = [load for g in ready for load in g.loads()]
        return engine_pb2.ModelInfo(
            model_path=first.model_path, architecture=first.architecture,
            max_model_len=engine.serving.max_model_len, vocab_size=first.vocab_size,
            block_size=first.block_size, num_blocks=sum(lane.blocks_total for lane in lanes),
            max_num_seqs=engine.config.max_num_seqs, num_lanes=len(lanes),
            supports_images=engine.serving.supports_images, dtype=first.dtype)

    async def GetServerInfo(self, request: engine_pb2.ServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> engine_pb2.ServerInfo:
        engine = self.engine
        info = engine_pb2.ServerInfo(protocol_version=PROTOCOL_VERSION, version=ttserve.__version__,
                                     ready=engine.ready, draining=engine.draining)
        for worker in engine.workers.values():
            d = worker.description
            lanes = worker.loads()
            info.workers.add(address=worker.address, ready=worker.ready,
                             backend=d.backend if d else "", mesh=d.device if d else "",
                             num_lanes=len(lanes), num_steps=worker.num_steps,
                             num_running=sum(lane.running for lane in lanes),
                             num_waiting=sum(lane.waiting for lane in lanes),
                             kv_blocks_used=sum(lane.blocks_used for lane in lanes),
                             kv_blocks_total=sum(lane.blocks_total for lane in lanes),
                             stalled=worker.stalled, state=worker.state, name=worker.name,
                             draining=worker.draining)
        return info


async def serve(engine: Engine, host: str, port: int, tls: Tls = PLAINTEXT) -> GrpcService:
    def register(server: grpc.aio.Server) -> None:
        engine_pb2_grpc.add_EngineServicer_to_server(EngineService(engine), server)

    return await start_server(host, port, register,
                              [engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name],
                              "control plane", tls)
