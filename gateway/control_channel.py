"""The gateway's gRPC channel to the control plane, for the start-up wait and the session alike.

gRPC's own reconnect backoff grows to a 120 s ceiling: a gateway that waited long for a control
plane (or lost it) would then find it up to two minutes after it is back. Here the ceiling is
2 s, so a control plane that comes up (or back) is found within a couple of seconds.

Importing this module is cheap (no vLLM).
"""
from __future__ import annotations

import grpc

from ttserve.protocol import CHANNEL_OPTIONS as SERVICE_CHANNEL_OPTIONS
from ttserve.tls import Tls, open_channel

CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
) + SERVICE_CHANNEL_OPTIONS


def open_control_channel(target: str, tls: Tls) -> grpc.aio.Channel:
    return open_channel(target, tls, CHANNEL_OPTIONS)
