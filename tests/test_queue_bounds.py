"""The queue's bounds in requests and bytes, overall and per tenant (control/queue_bounds.py)."""
from __future__ import annotations

from ttserve.control.queue_bounds import Ledger, QueueBounds
from ttserve.control.request import Request, SamplingParams

MIB = 1 << 20


def ledger_of(*groups: tuple[str, int, int]) -> tuple[Ledger, list[Request]]:
    """A ledger holding, for each (tenant, count, bytes each), that many requests."""
    ledger, live = Ledger(), []
    for tenant, n, held in groups:
        for i in range(n):
            request = Request(f"{tenant}-{i}", [1, 2, 3], SamplingParams(max_tokens=4), tenant=tenant,
                              held_bytes=held)
            ledger.add(request)
            live.append(request)
    return ledger, live


def test_the_totals_bound_every_arrival():
    bounds = QueueBounds(max_num_queued_reqs=4, max_held_bytes=10 * MIB, tenant_share=1.0)
    ledger, _ = ledger_of(("", 3, 3 * MIB))
    assert ledger.refusal(bounds, 3, 8, "", 1000) is None
    assert "4 requests are already waiting (--max-num-queued-reqs 4)" in ledger.refusal(bounds, 4, 8, "", 1000)
    assert "--max-held-bytes 10.0 MiB" in ledger.refusal(bounds, 0, 8, "", 2 * MIB)


def test_a_tenant_past_its_share_is_refused_while_others_are_admitted():
    bounds = QueueBounds(max_num_queued_reqs=6, max_held_bytes=100 * MIB, tenant_share=0.5)
    ledger, _ = ledger_of(("alice", 4, 1000))
    # (6 queued + 2 rows) * 0.5 = 4 live requests per tenant.
    assert "tenant 'alice' already has 4 requests" in ledger.refusal(bounds, 2, 2, "alice", 1000)
    assert ledger.refusal(bounds, 2, 2, "bob", 1000) is None
    # Bytes too: alice holds 40 MiB; 15 MiB more passes her 50 MiB share.
    heavy, _ = ledger_of(("alice", 3, 10 * MIB))
    assert "past its share (0.5 of --max-held-bytes" in heavy.refusal(bounds, 0, 2, "alice", 25 * MIB)
    assert heavy.refusal(bounds, 0, 2, "bob", 15 * MIB) is None


def test_requests_without_a_tenant_share_no_quota():
    bounds = QueueBounds(max_num_queued_reqs=8, max_held_bytes=100 * MIB, tenant_share=0.5)
    ledger, _ = ledger_of(("", 7, 1000))
    assert ledger.refusal(bounds, 7, 0, "", 1000) is None


def test_the_ledger_returns_to_empty_when_its_requests_leave():
    ledger, live = ledger_of(("a", 3, 5), ("", 2, 7), ("b", 1, 11))
    for request in live:
        ledger.remove(request)
    assert ledger.held_bytes == 0 and not ledger.tenant_requests and not ledger.tenant_bytes
