"""Overload is refused cleanly: beyond --max-num-queued-reqs waiting requests the control plane
answers VERDICT_OVERLOADED and the gateway HTTP 503 with Retry-After, admitted requests complete,
and the stack serves normally afterwards. Real processes on loopback ports."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from stack import metric, start_stack
from ttserve.control_client import ControlClient
from ttserve.v1 import engine_pb2

pytestmark = pytest.mark.e2e

QUEUE = ("--max-num-queued-reqs", "1", "--max-num-seqs", "1")


@pytest.fixture(scope="module")
def queue_stack(tmp_path_factory, smollm2):
    """One row and one queue place, with a gateway: the control plane's refusal (to a gRPC client)
    and the gateway's (HTTP 503) are checked on the same stack. Each test leaves it idle."""
    stack = start_stack(tmp_path_factory.mktemp("queue"), str(smollm2), control_flags=QUEUE)
    yield stack
    stack.stop()


def test_the_control_plane_refuses_arrivals_beyond_the_queue_bound(queue_stack):
    stack = queue_stack
    client = ControlClient(stack.control_address)
    refused_before = metric(stack.control_metrics_url, "ttserve_requests_refused_total", reason="overloaded") or 0
    try:
        ids = [f"r{i}" for i in range(6)]
        for rid in ids:
            client.add(rid, [1, 2, 3], 8, eos_token_ids=())
        verdicts = client.admissions(ids)
        refused = [a for a in verdicts.values() if a.verdict == engine_pb2.Admission.VERDICT_OVERLOADED]
        accepted = {a.request_id for a in verdicts.values() if a.verdict == engine_pb2.Admission.VERDICT_ACCEPTED}
        assert refused and accepted and len(refused) + len(accepted) == len(ids)
        assert "already waiting (--max-num-queued-reqs 1); retry later" in refused[0].message
        done = client.collect(accepted)
        assert all(r.finish_reason == engine_pb2.FinishReason.FINISH_REASON_LENGTH for r in done.values())
        client.add("after", [1, 2, 3], 4, eos_token_ids=())  # serves normally once the burst is over
        assert len(client.collect({"after"})["after"].token_ids) == 4
        assert (metric(stack.control_metrics_url, "ttserve_requests_refused_total", reason="overloaded")
                == refused_before + len(refused))
    finally:
        client.close()


def test_the_gateway_answers_an_overload_with_503_and_retry_after(queue_stack, smollm2):
    stack = queue_stack

    def complete(i: int) -> tuple[int, dict, str]:
        body = json.dumps({"model": smollm2.name, "prompt": f"Count to {i}:", "max_tokens": 8}).encode()
        request = urllib.request.Request(f"{stack.http_url}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode()

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(complete, range(8)))
    statuses = [status for status, _, _ in answers]
    assert set(statuses) <= {200, 503} and 200 in statuses and 503 in statuses, answers
    status, headers, body = next(a for a in answers if a[0] == 503)
    assert headers.get("retry-after") == "1" and "--max-num-queued-reqs 1" in body, (headers, body)
    assert complete(99)[0] == 200  # and serves normally afterwards


def test_a_burst_of_ten_times_capacity_is_bounded_and_served(tmp_path, smollm2):
    """4 rows + 8 queued = 12 requests of capacity; 120 arrive at once. Admitted ones complete,
    the rest are refused as overloaded, memory stays flat, and the stack serves normally after."""
    import psutil

    flags = ("--max-num-queued-reqs", "8", "--max-num-seqs", "4")
    stack = start_stack(tmp_path, str(smollm2), gateway=False, control_flags=flags,
                        worker_flags=("--backend", "sim", "--sim-profile", "galaxy-llama-3.3-70b"))
    client = ControlClient(stack.control_address)
    try:
        procs = {s.name: psutil.Process(s.proc.pid) for s in stack.services}
        client.add("warm", [1, 2, 3], 4, eos_token_ids=())
        client.collect({"warm"})
        before = {name: p.memory_info().rss for name, p in procs.items()}
        ids = [f"b{i}" for i in range(120)]
        for rid in ids:
            client.add(rid, [1, 2, 3] * 10, 16, eos_token_ids=())
        # Outputs of requests admitted early arrive among the verdicts: admissions() keeps them.
        verdicts = {rid: a.verdict for rid, a in client.admissions(ids).items()}
        accepted = {rid for rid, v in verdicts.items() if v == engine_pb2.Admission.VERDICT_ACCEPTED}
        overloaded = [rid for rid, v in verdicts.items() if v == engine_pb2.Admission.VERDICT_OVERLOADED]
        assert len(accepted) + len(overloaded) == len(ids) and 0 < len(accepted) < len(ids)
        done = client.collect(accepted)
        short = {rid: (len(r.token_ids), r.finish_reason, r.error) for rid, r in done.items() if len(r.token_ids) != 16}
        assert not short, short  # (tokens, finish reason, error) of each accepted request cut short
        growth = {name: (p.memory_info().rss - before[name]) >> 20 for name, p in procs.items()}
        assert all(mib < 64 for mib in growth.values()), growth  # MiB: bounded, not a leak per request
        client.add("after", [1, 2, 3], 4, eos_token_ids=())
        assert len(client.collect({"after"})["after"].token_ids) == 4
    finally:
        client.close()
        stack.stop()
