"""What the control plane's queue may hold, in requests and in bytes, overall and per tenant.

A count of waiting requests alone bounds neither memory (a request holds its prompt and its
images, up to the 63 MiB of one message, until it finishes: a preempted or migrated request
recomputes from them) nor fairness (one client could fill the whole queue and every other client
would be refused). So an arrival is refused (RESOURCE_EXHAUSTED: HTTP 503 with Retry-After) when

- the waiting requests reach --max-num-queued-reqs, or
- the bytes held by live requests (each counted at its AddRequest's wire size) would pass
  --max-held-bytes, or
- its tenant (the gateway's name for the API key that sent it) already has its share of either:
  --tenant-queue-share of the waiting requests, or of --max-held-bytes. Requests without a tenant
  (a gateway without keys, or a direct engine.proto client) share no quota: they are one client
  as far as the control plane can tell, and are bounded by the totals alone.

The first refusals of a flood thus fall on the flooding tenant; the others are still admitted
until the totals are reached. Pure: the engine passes its live requests.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .request import Request, RequestStatus

DEFAULT_MAX_HELD_BYTES = 4 << 30  # --max-held-bytes
DEFAULT_TENANT_SHARE = 0.5        # --tenant-queue-share


@dataclass(slots=True, frozen=True)
class QueueBounds:
    max_num_queued_reqs: int = 1024
    max_held_bytes: int = DEFAULT_MAX_HELD_BYTES
    tenant_share: float = DEFAULT_TENANT_SHARE  # of each bound, per named tenant; 1.0: no per-tenant bound


def refusal(bounds: QueueBounds, live: Iterable[Request], tenant: str, size: int) -> str | None:
    """Why an arrival of `size` bytes from `tenant` is refused now, or None to admit it."""
    waiting = held = tenant_waiting = tenant_held = 0
    for request in live:
        queued = request.status is RequestStatus.WAITING
        waiting += queued
        held += request.held_bytes
        if tenant and request.tenant == tenant:
            tenant_waiting += queued
            tenant_held += request.held_bytes
    if waiting >= bounds.max_num_queued_reqs:
        return (f"{waiting} requests are already waiting (--max-num-queued-reqs "
                f"{bounds.max_num_queued_reqs}); retry later")
    if held + size > bounds.max_held_bytes:
        return (f"the requests held take {_mib(held)} and this one {_mib(size)}, more than "
                f"--max-held-bytes {_mib(bounds.max_held_bytes)}; retry later")
    if tenant and bounds.tenant_share < 1:
        share = max(int(bounds.max_num_queued_reqs * bounds.tenant_share), 1)
        if tenant_waiting >= share:
            return (f"tenant {tenant!r} already has {tenant_waiting} requests waiting, its share of the "
                    f"queue ({bounds.tenant_share:g} of --max-num-queued-reqs {bounds.max_num_queued_reqs}); "
                    "retry later")
        byte_share = int(bounds.max_held_bytes * bounds.tenant_share)
        if tenant_held + size > byte_share:
            return (f"tenant {tenant!r} holds {_mib(tenant_held)} of requests and this one is {_mib(size)}, "
                    f"past its share ({bounds.tenant_share:g} of --max-held-bytes {_mib(bounds.max_held_bytes)}); "
                    "retry later")
    return None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
