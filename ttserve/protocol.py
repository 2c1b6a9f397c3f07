"""The wire protocol's version and how peers check it.

Every gRPC call between ttserve services carries the caller's protocol version as metadata; the
server refuses a different version before any handler runs, and clients compare the version a
server reports in Describe / GetServerInfo. Bump PROTOCOL_VERSION on any change a peer of the
previous version would misread (fields are only ever added, so that is rare).
"""
from __future__ import annotations

from typing import Any, Callable

import grpc

# 2: host-sampler options and logprobs (a version-1 worker would silently ignore them).
# 3: images (AddRequest.mm_inputs, PrefillChunk.mm_inputs): a version-2 peer would drop them.
# 4: the step stream's accept (initial metadata once the worker holds it) and drain notice: a
#    version-3 control plane would place requests on a worker that has not taken its stream.
# 5: a failed step (StepResult.error) no longer ends the step stream: the worker drops its device
#    state and serves on; a version-4 control plane would apply later steps' refusals as faults.
# 6: resumed requests (AddRequest.resumption): a version-5 control plane would start them over
#    and the client would see their tokens twice.
# 7: the step stream's probe (StepResult.probe, StepBatch.probe_answer): a version-6 control plane
#    would not answer, and a second control plane would take its workers while it serves.
# 8: hybrid KV cache groups (DeviceDescription.kv_groups, the items' GroupBlocks): a version-7
#    control plane would give a hybrid model one block table, and its sliding layers' KV no room;
#    and speculative decoding (DecodeItem.draft_token_ids, SampledToken.num_accepted_drafts),
#    which a version-7 worker would silently ignore.
PROTOCOL_VERSION = 8
METADATA_KEY = "ttserve-protocol-version"
CALL_METADATA: tuple[tuple[str, str], ...] = ((METADATA_KEY, str(PROTOCOL_VERSION)),)
# Every ttserve server and channel: a step's outputs or a long prompt can exceed gRPC's 4 MiB.
MESSAGE_LIMITS: tuple[tuple[str, int], ...] = (("grpc.max_receive_message_length", 64 << 20),
                                               ("grpc.max_send_message_length", 64 << 20))

# HTTP/2 keepalive on every channel: a peer that vanished without closing its connection (a host
# powered off, a partition) is found within ~30 s instead of at the kernel's TCP timeout, and
# idle streams (a step stream between requests) stay alive through middleboxes.
# grpc 1.85 closes a transport on an unanswered ping after grpc.http2.ping_timeout_ms (default
# 60 s), not after grpc.keepalive_timeout_ms alone: measured, a server with keepalive_time 2 s kept
# a SIGSTOPped client's stream open indefinitely until ping_timeout_ms was set, then ended it in 5 s.
KEEPALIVE: tuple[tuple[str, int], ...] = (("grpc.keepalive_time_ms", 20_000),
                                          ("grpc.keepalive_timeout_ms", 10_000),
                                          ("grpc.http2.ping_timeout_ms", 10_000),
                                          ("grpc.keepalive_permit_without_calls", 1),
                                          ("grpc.http2.max_pings_without_data", 0))
# What servers accept of it (gRPC servers refuse pings more often than every 5 minutes by default).
KEEPALIVE_ACCEPTED: tuple[tuple[str, int], ...] = (("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
                                                   ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                                                   ("grpc.keepalive_permit_without_calls", 1))
# Servers ping their clients too: a worker whose control plane vanished (its host powered off, a
# partition) ends that step stream within ~30 s (sooner when a new control plane asks for the
# worker: worker/server.py probes the stream); a control plane drops a vanished gateway's session
# (and aborts its requests) the same way.
SERVER_KEEPALIVE: tuple[tuple[str, int], ...] = (("grpc.keepalive_time_ms", 20_000),
                                                 ("grpc.keepalive_timeout_ms", 10_000),
                                                 ("grpc.http2.ping_timeout_ms", 10_000),
                                                 ("grpc.http2.max_pings_without_data", 0))
CHANNEL_OPTIONS = MESSAGE_LIMITS + KEEPALIVE
SERVER_OPTIONS = MESSAGE_LIMITS + KEEPALIVE_ACCEPTED + SERVER_KEEPALIVE


def host_port(host: str, port: int) -> str:
    """`host:port` as gRPC targets and URLs write it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ProtocolMismatch(RuntimeError):
    """The peer speaks another protocol version."""


def mismatch_message(peer_version: object, peer: str) -> str:
    return (f"ttserve protocol mismatch: {peer} speaks protocol version {peer_version}, this "
            f"process speaks version {PROTOCOL_VERSION}; upgrade both to the same ttserve release")


def check_peer_version(peer_version: int, peer: str) -> None:
    """Raise ProtocolMismatch unless a peer's reported version equals ours."""
    if peer_version != PROTOCOL_VERSION:
        raise ProtocolMismatch(mismatch_message(peer_version, peer))


class ProtocolVersionInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls whose metadata names another protocol version (FAILED_PRECONDITION).

    Calls without the key (grpcurl, health probes, reflection) pass: only a peer that states a
    different version is known to be incompatible.
    """

    def __init__(self, service_prefix: str = "/ttserve.") -> None:
        self._prefix = service_prefix

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        if not details.method.startswith(self._prefix):
            return await continuation(details)
        stated = dict(details.invocation_metadata or ()).get(METADATA_KEY)
        if stated is None or stated == str(PROTOCOL_VERSION):
            return await continuation(details)
        message = mismatch_message(stated, "the client")
        return _refusal(await continuation(details), message)


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    async def refuse(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)

    async def refuse_stream(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)
        yield  # pragma: no cover - makes this an async generator

    if handler is None:  # a method this server lacks: refused all the same, its messages unread
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    kwargs = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **kwargs)
