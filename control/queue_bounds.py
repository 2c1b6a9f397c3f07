"""What the control plane's queue may hold, in requests and in bytes, overall and per tenant.

A count of waiting requests alone bounds neither memory (a request holds its prompt and its
images, up to the 63 MiB of one message, until it finishes: a preempted or migrated request
recomputes from them) nor fairness (one client could fill the whole queue and every other client
would be refused). So an arrival is refused (RESOURCE_EXHAUSTED: HTTP 503 with Retry-After) when

- the waiting requests reach --max-num-queued-reqs, or
- the bytes held by live requests (each counted at its AddRequest's wire size) would pass
  --max-held-bytes, or
- its tenant (the gateway's name for the API key that sent it) already holds its share of either:
  --tenant-queue-share of the live requests the workers can hold (their rows plus
  --max-num-queued-reqs), or of --max-held-bytes. Requests without a tenant (a gateway without
  keys, or a direct engine.proto client) share no quota: they are one client as far as the
  control plane can tell, and are bounded by the totals alone.

The first refusals of a flood thus fall on the flooding tenant; the others are still admitted
until the totals are reached. `Ledger` keeps the per-tenant sums as requests come and go, so an
admission costs the same with 16 or 16k live requests.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .request import Request

DEFAULT_MAX_HELD_BYTES = 4 << 30  # --max-held-bytes
DEFAULT_TENANT_SHARE = 0.5        # --tenant-queue-share


@dataclass(slots=True, frozen=True)
class QueueBounds:
    max_num_queued_reqs: int = 1024
    max_held_bytes: int = DEFAULT_MAX_HELD_BYTES
    tenant_share: float = DEFAULT_TENANT_SHARE  # of each bound, per named tenant; 1.0: no per-tenant bound


@dataclass(slots=True)
class Ledger:
    """Live requests and the bytes they hold, in total and by tenant. Its owner (the engine)
    calls `add` when it admits a request and `remove` when it forgets it: exactly once each."""
    held_bytes: int = 0
    tenant_requests: Counter[str] = field(default_factory=Counter)
    tenant_bytes: Counter[str] = field(default_factory=Counter)

    def add(self, request: Request) -> None:
        self.held_bytes += request.held_bytes
        if request.tenant:
            self.tenant_requests[request.tenant] += 1
            self.tenant_bytes[request.tenant] += request.held_bytes

    def remove(self, request: Request) -> None:
        self.held_bytes -= request.held_bytes
        if request.tenant:
            self.tenant_requests[request.tenant] -= 1
            self.tenant_bytes[request.tenant] -= request.held_bytes
            if not self.tenant_requests[request.tenant]:
                del self.tenant_requests[request.tenant], self.tenant_bytes[request.tenant]

    def refusal(self, bounds: QueueBounds, waiting: int, rows: int, tenant: str, size: int) -> str | None:
        """Why an arrival of `size` bytes from `tenant` is refused now, or None to admit it.
        `waiting`: requests queued now (all lanes, and migrating ones); `rows`: the serving
        workers' rows (running requests are live, not queued)."""
        if waiting >= bounds.max_num_queued_reqs:
            return (f"{waiting} requests are already waiting (--max-num-queued-reqs "
                    f"{bounds.max_num_queued_reqs}); retry later")
        if self.held_bytes + size > bounds.max_held_bytes:
            return (f"the requests held take {_mib(self.held_bytes)} and this one {_mib(size)}, more than "
                    f"--max-held-bytes {_mib(bounds.max_held_bytes)}; retry later")
        if not tenant or bounds.tenant_share >= 1:
            return None
        share = max(int((bounds.max_num_queued_reqs + rows) * bounds.tenant_share), 1)
        if self.tenant_requests[tenant] >= share:
            return (f"tenant {tenant!r} already has {self.tenant_requests[tenant]} requests, its share "
                    f"({bounds.tenant_share:g} of the {rows} rows and --max-num-queued-reqs "
                    f"{bounds.max_num_queued_reqs}); retry later")
        byte_share = int(bounds.max_held_bytes * bounds.tenant_share)
        if self.tenant_bytes[tenant] + size > byte_share:
            return (f"tenant {tenant!r} holds {_mib(self.tenant_bytes[tenant])} of requests and this one is "
                    f"{_mib(size)}, past its share ({bounds.tenant_share:g} of --max-held-bytes "
                    f"{_mib(bounds.max_held_bytes)}); retry later")
        return None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
