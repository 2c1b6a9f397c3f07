"""The gateway's gRPC channels to its control planes (--control lists one or more), and which of
them it uses: the first, in the listed order, that answers ready.

gRPC's own reconnect backoff grows to a 120 s ceiling: a gateway that waited long for a control
plane (or lost it) would then find it up to two minutes after it is back. Here the ceiling is
2 s, so a control plane that comes up (or back) is found within a couple of seconds.

Several control planes share nothing with each other: each schedules on its own, holds its own
KV block tables and prefix cache, and a worker serves one of them at a time (its step stream;
worker/server.py). Listed over the same workers, one serves and the others wait as standbys
that report not ready until the serving one is gone and the workers take their streams.

Importing this module is cheap (no vLLM).
"""
from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass

import grpc

from ttserve.gateway.readiness import describe_workers
from ttserve.protocol import CALL_METADATA, ProtocolMismatch, check_peer_version
from ttserve.protocol import CHANNEL_OPTIONS as SERVICE_CHANNEL_OPTIONS
from ttserve.tls import Tls, handshake_hint, open_channel
from ttserve.v1 import engine_pb2, engine_pb2_grpc

CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
) + SERVICE_CHANNEL_OPTIONS


def open_control_channel(target: str, tls: Tls) -> grpc.aio.Channel:
    return open_channel(target, tls, CHANNEL_OPTIONS)


def control_targets(text: str) -> tuple[str, ...]:
    """--control's value: HOST:PORT, or several, comma-separated, in the order they are preferred."""
    targets = tuple(t.strip() for t in text.split(","))
    if not all(targets):
        raise argparse.ArgumentTypeError(f"expected HOST:PORT[,HOST:PORT...], got {text!r}")
    if len(set(targets)) != len(targets):
        raise argparse.ArgumentTypeError(f"a control plane is listed twice in {text!r}")
    return targets


@dataclass(slots=True)
class ControlPlane:
    target: str
    channel: grpc.aio.Channel
    stub: engine_pb2_grpc.EngineStub


@dataclass(slots=True)
class Answer:
    """One control plane's answer to GetServerInfo: its info, or why there is none (`refused`:
    it turned this gateway away at the protocol check, which waiting cannot end; `why` is then a
    sentence naming it, else a phrase for after its address)."""
    plane: ControlPlane
    info: engine_pb2.ServerInfo | None
    why: str = ""
    refused: bool = False

    @property
    def ready(self) -> bool:
        return self.info is not None and self.info.ready and not self.info.draining

    def describe(self, named: bool) -> str:
        """Why it is not ready, for a person; `named`: after its address."""
        if self.info is None:
            why = self.why
        elif self.info.draining:
            why = "shutting down"
        else:
            why = "ready" if self.info.ready else f"no ready worker ({describe_workers(self.info)})"
        return f"{self.plane.target} {why}" if named and not self.refused else why


class ControlPlanes:
    """The listed control planes, each with a channel of its own, in the order of preference."""

    def __init__(self, targets: tuple[str, ...] | list[str], tls: Tls) -> None:
        assert targets, "at least one control plane"
        self.tls = tls
        self.planes = [ControlPlane(t, channel := open_control_channel(t, tls), engine_pb2_grpc.EngineStub(channel))
                       for t in targets]

    @property
    def targets(self) -> list[str]:
        return [p.target for p in self.planes]

    def describe(self) -> str:
        """The listed addresses, for a person to read."""
        return ("the control plane at " + self.planes[0].target if len(self.planes) == 1 else
                "the control planes at " + ", ".join(self.targets))

    async def ask(self, timeout: float) -> list[Answer]:
        """Every control plane's ServerInfo, asked at once, in the listed order."""
        return list(await asyncio.gather(*(self._ask(p, timeout) for p in self.planes)))

    async def _ask(self, plane: ControlPlane, timeout: float) -> Answer:
        try:
            info = await plane.stub.GetServerInfo(engine_pb2.ServerInfoRequest(), metadata=CALL_METADATA,
                                                  timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # the protocol interceptor
                return Answer(plane, None, f"control plane at {plane.target} refused this gateway: {e.details()}",
                              refused=True)
            # Any other refusal is waited out too: the peer at that address may change.
            unreachable = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            return Answer(plane, None, f"{'unreachable' if unreachable else 'refusing GetServerInfo'} "
                                       f"({e.code().name}: {e.details()}{handshake_hint(e.details(), self.tls)})")
        try:
            check_peer_version(info.protocol_version, f"the control plane at {plane.target}")
        except ProtocolMismatch as e:
            return Answer(plane, None, str(e), refused=True)
        return Answer(plane, info)

    @staticmethod
    def choose(answers: list[Answer]) -> Answer | None:
        """The control plane to use: the first ready one; with a single one listed, also when it
        answers not ready (requests then get its 503 saying why); else None."""
        for answer in answers:
            if answer.ready:
                return answer
        if len(answers) == 1 and answers[0].info is not None:
            return answers[0]
        return None

    async def close(self) -> None:
        await asyncio.gather(*(p.channel.close() for p in self.planes))
