"""The queue's bounds in requests and bytes, overall and per tenant (control/queue_bounds.py)."""
from __future__ import annotations

from ttserve.control.queue_bounds import QueueBounds, refusal
from ttserve.control.request import Request, RequestStatus, SamplingParams

MIB = 1 << 20


def live(tenant: str, n: int, held: int = 1000, status: RequestStatus = RequestStatus.WAITING) -> list[Request]:
    return [Request(f"{tenant}-{i}", [1, 2, 3], SamplingParams(max_tokens=4), tenant=tenant,
                    held_bytes=held, status=status) for i in range(n)]


def test_the_totals_bound_every_arrival():
    bounds = QueueBounds(max_num_queued_reqs=4, max_held_bytes=10 * MIB, tenant_share=1.0)
    assert refusal(bounds, live("", 3), "", 1000) is None
    assert "4 requests are already waiting (--max-num-queued-reqs 4)" in refusal(bounds, live("", 4), "", 1000)
    # Running requests do not wait, but they hold their bytes.
    running = live("", 4, held=3 * MIB, status=RequestStatus.RUNNING)
    assert refusal(bounds, running[:3], "", 1000) is None
    assert "--max-held-bytes 10.0 MiB" in refusal(bounds, running, "", 1000)


def test_a_tenant_past_its_share_is_refused_while_others_are_admitted():
    bounds = QueueBounds(max_num_queued_reqs=8, max_held_bytes=100 * MIB, tenant_share=0.5)
    flood = live("alice", 4)
    message = refusal(bounds, flood, "alice", 1000)
    assert message is not None and "tenant 'alice' already has 4 requests waiting" in message
    assert refusal(bounds, flood, "bob", 1000) is None
    # Bytes too: alice holds 40 MiB of running requests; 15 MiB more passes her 50 MiB share.
    heavy = live("alice", 4, held=10 * MIB, status=RequestStatus.RUNNING)
    assert "past its share (0.5 of --max-held-bytes" in refusal(bounds, heavy, "alice", 15 * MIB)
    assert refusal(bounds, heavy, "bob", 15 * MIB) is None


def test_requests_without_a_tenant_share_no_quota():
    bounds = QueueBounds(max_num_queued_reqs=8, max_held_bytes=100 * MIB, tenant_share=0.5)
    assert refusal(bounds, live("", 7), "", 1000) is None
    assert refusal(bounds, live("", 8), "", 1000) is not None
