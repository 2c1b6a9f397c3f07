"""How every ttserve gRPC service listens: protocol check, health, reflection, message limits,
and a stop on SIGTERM/SIGINT."""
from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .ops_http import OpsEndpoints, start_ops_server
from .protocol import SERVER_OPTIONS, ProtocolVersionInterceptor, host_port
from .tls import PLAINTEXT, Tls

log = logging.getLogger(__name__)


class ListenError(OSError):
    """The address cannot be bound (in use, not local)."""


@dataclass(slots=True)
class GrpcService:
    server: grpc.aio.Server
    health: health.aio.HealthServicer

    async def drain(self) -> None:
        """Health turns NOT_SERVING (load balancers and probes stop sending work); the server
        keeps serving the calls and streams it has."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace)


async def start_server(host: str, port: int, register: Callable[[grpc.aio.Server], None],
                       service_names: Sequence[str], what: str, tls: Tls = PLAINTEXT) -> GrpcService:
    """A started server with `register`'s servicers plus gRPC health and reflection; TLS (mutual
    when `tls` has a CA) when `tls` holds a certificate, plaintext otherwise."""
    server = grpc.aio.server(interceptors=[ProtocolVersionInterceptor()], options=SERVER_OPTIONS)
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*service_names, reflection.SERVICE_NAME, health.SERVICE_NAME),
                                        server)
    address = host_port(host, port)
    credentials = tls.server_credentials()
    try:
        bound = (server.add_insecure_port(address) if credentials is None else
                 server.add_secure_port(address, credentials))
    except RuntimeError as e:
        raise ListenError(f"cannot listen on {address}: {e}") from e
    if bound == 0:
        raise ListenError(f"cannot listen on {address}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("%s listening on %s (%s)", what, address,
             "mutual TLS" if tls.mutual else "TLS" if tls.serves_tls else "plaintext")
    return GrpcService(server, health_servicer)


async def wait_for_stop(*also: asyncio.Future) -> None:
    """Returns on SIGTERM or SIGINT, or as soon as any of `also` is done."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({stopped, *also}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()


async def run_service(start: Awaitable[GrpcService], metrics_at: tuple[str, int],
                      endpoints: OpsEndpoints, what: str, drain: Callable[[], Awaitable[None]],
                      *stop_early: asyncio.Future) -> bool:
    """Start the gRPC service (`start`) and the operations endpoint on `metrics_at` (port 0:
    none); serve until SIGTERM or SIGINT — then drain: gRPC health turns NOT_SERVING and
    `drain()` runs — or until any of `stop_early` is done (no drain). Both servers are stopped on
    return. False when either cannot listen (logged)."""
    host, port = metrics_at
    try:
        service = await start
    except ListenError as e:
        log.error("%s", e)
        return False
    try:
        ops = await start_ops_server(host, port, endpoints, what) if port else None
    except OSError as e:
        log.error("%s", e)
        await service.stop(0)
        return False
    try:
        await wait_for_stop(*stop_early)
        if not any(f.done() for f in stop_early):
            log.info("%s shutting down: admitting nothing new", what)
            await service.drain()
            await drain()
    finally:
        await service.stop(grace=1.0)
        if ops is not None:
            await ops.close()
    return True
