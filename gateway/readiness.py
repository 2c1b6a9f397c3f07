"""`GET /ready`: whether this gateway can serve a request now, and if not, why.

Ready means: the gateway is not draining, it holds a session with a control plane, and that
control plane answers GetServerInfo with `ready` (at least one warmed-up worker) and not
`draining`. `/health` stays the liveness probe (vLLM's route over GatewayLLM.check_health).

The control plane is asked at most once per `cache_s` (probes from several balancers share one
answer) and each call has a short deadline, so a hung control plane makes /ready say so within
about a second instead of hanging the probe.

Importing this module is cheap (no vLLM).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

import grpc

from ttserve.gateway.drain import Drain
from ttserve.v1 import engine_pb2


class ControlPlane(Protocol):
    """What readiness needs from the gateway's control-plane client (GrpcEngineCoreClient)."""
    @property
    def target(self) -> str: ...  # the address of the session's control plane

    @property
    def connected(self) -> bool: ...

    @property
    def unreachable_message(self) -> str: ...

    async def get_server_info(self, timeout: float) -> engine_pb2.ServerInfo: ...


def describe_workers(info: engine_pb2.ServerInfo) -> str:
    """The control plane's workers and their states, for a person to read."""
    if not info.workers:
        return "no workers"
    return "; ".join(f"worker {w.address}: {w.state or ('ready' if w.ready else 'not ready')}"
                     for w in info.workers)


class ReadinessProbe:
    def __init__(self, control: ControlPlane, drain: Drain, *, rpc_timeout_s: float = 1.0,
                 cache_s: float = 1.0) -> None:
        self.control = control
        self.drain = drain
        self.rpc_timeout_s = rpc_timeout_s
        self.cache_s = cache_s
        self._answer: tuple[float, engine_pb2.ServerInfo | str] | None = None  # (when, info or error)
        self._lock = asyncio.Lock()

    async def _server_info(self) -> engine_pb2.ServerInfo | str:
        """The control plane's ServerInfo, or why it could not be had; at most cache_s old."""
        async with self._lock:
            if self._answer is not None and time.monotonic() - self._answer[0] < self.cache_s:
                return self._answer[1]
            try:
                answer: engine_pb2.ServerInfo | str = await self.control.get_server_info(
                    self.rpc_timeout_s)
            except grpc.aio.AioRpcError as e:
                answer = f"control plane at {self.control.target} is unreachable " \
                         f"({e.code().name}: {e.details()})"
            self._answer = (time.monotonic(), answer)
            return answer

    async def not_ready_reason(self) -> str | None:
        """None when ready; otherwise why not."""
        if self.drain.draining:
            return "the gateway is shutting down"
        if not self.control.connected:  # the client says why (each listed control plane's state)
            return self.control.unreachable_message
        info = await self._server_info()
        target = self.control.target
        if isinstance(info, str):
            return info
        if info.draining:
            return f"the control plane at {target} is shutting down"
        if not info.ready:
            return f"the control plane at {target} has no ready worker ({describe_workers(info)})"
        return None


def service_unavailable(message: str) -> dict[str, Any]:
    """A 503's body, in the shape of vLLM's (and OpenAI's) error bodies."""
    return {"error": {"message": message, "type": "Service Unavailable", "param": None, "code": 503}}


def install(app: Any, probe: ReadinessProbe) -> None:
    """Add GET /ready to `app` (the FastAPI app from vLLM's build_app)."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def ready(request: Request) -> JSONResponse:
        reason = await probe.not_ready_reason()
        if reason is None:
            return JSONResponse({"status": "ready"})
        return JSONResponse(service_unavailable(f"not ready: {reason}"), status_code=503)

    app.router.routes.insert(0, Route("/ready", ready, methods=["GET"], name="ttserve_ready"))
