"""Requests survive a lost worker: SIGKILL a worker mid-stream and its requests move to another
worker (or to it once it is restarted), recompute from prompt + the tokens they have, and finish
with exactly the tokens an uninterrupted run gives (greedy); past --migration-limit or
--migration-timeout they fail with the cause. Real processes on loopback ports."""
from __future__ import annotations

import signal

import pytest

from stack import metric, start_stack, start_worker, wait_until
from ttserve.control_client import ControlClient, Result
from ttserve.v1 import engine_pb2

pytestmark = pytest.mark.e2e

FINISH = engine_pb2.FinishReason
PROMPT = [1, 9690, 314, 253, 1932, 30, 2]  # any fixed ids: greedy decoding makes the run reproducible
MAX_TOKENS = 48
# fp32: a recomputed prefill and the decode steps it replaces agree to the last bit far more
# often than in bf16, so the greedy oracle holds across a migration (ties aside).
WORKER_FLAGS = ("--dtype", "float32", "--num-threads", "1")


def stream(client: ControlClient, request_id: str, until: int) -> Result:
    """Read `request_id`'s outputs until it has `until` tokens (or has finished)."""
    result = Result()
    while len(result.token_ids) < until and not result.finish_reason:
        message = client.next()
        if message.HasField("admission"):
            assert message.admission.verdict == engine_pb2.Admission.VERDICT_ACCEPTED, message
            continue
        for out in message.outputs.outputs:
            if out.request_id == request_id:
                result.token_ids += out.new_token_ids
                result.placements.add((out.worker, out.lane))
                if out.finish_reason:
                    result.finish_reason, result.error = out.finish_reason, out.error
    return result


def rest(client: ControlClient, request_id: str, head: Result) -> Result:
    tail = client.collect({request_id}, timeout=300)[request_id]
    return Result(head.token_ids + tail.token_ids, tail.finish_reason, tail.error, head.placements | tail.placements)


def test_a_killed_workers_requests_finish_on_the_other_worker_with_the_same_tokens(tmp_path, smollm2):
    stack = start_stack(tmp_path, str(smollm2), gateway=False, workers=2, worker_flags=WORKER_FLAGS)
    client = ControlClient(stack.control_address)
    try:
        client.add("reference", PROMPT, MAX_TOKENS, eos_token_ids=())
        reference = client.collect({"reference"})["reference"]
        assert reference.finish_reason == FINISH.FINISH_REASON_LENGTH and reference.placements == {(0, 0)}

        client.add("moved", PROMPT, MAX_TOKENS, eos_token_ids=())
        head = stream(client, "moved", 8)
        assert head.placements == {(0, 0)} and not head.finish_reason
        stack.services[0].stop(signal.SIGKILL)
        result = rest(client, "moved", head)
        assert result.finish_reason == FINISH.FINISH_REASON_LENGTH, result.error
        assert result.token_ids == reference.token_ids  # nothing lost, nothing twice, the same tokens
        assert (1, 0) in result.placements
        assert metric(stack.control_metrics_url, "ttserve_request_migrations_total", outcome="requeued") >= 1
    finally:
        client.close()
        stack.stop()


def test_a_stalled_workers_requests_finish_on_the_other_worker_while_it_is_stopped(tmp_path, smollm2):
    stack = start_stack(tmp_path, str(smollm2), gateway=False, workers=2, worker_flags=WORKER_FLAGS,
                        control_flags=("--stall-timeout", "3"))
    client = ControlClient(stack.control_address)
    stalled = stack.services[0]
    try:
        client.add("reference", PROMPT, MAX_TOKENS, eos_token_ids=())
        reference = client.collect({"reference"})["reference"]
        client.add("moved", PROMPT, MAX_TOKENS, eos_token_ids=())
        head = stream(client, "moved", 8)
        assert head.placements == {(0, 0)} and not head.finish_reason
        stalled.proc.send_signal(signal.SIGSTOP)  # alive, holding its step, answering nothing
        try:
            result = rest(client, "moved", head)
            assert result.finish_reason == FINISH.FINISH_REASON_LENGTH, result.error
            assert result.token_ids == reference.token_ids  # nothing lost, nothing twice
            assert (1, 0) in result.placements
            assert metric(stack.control_metrics_url, "ttserve_worker_stalled", worker="0") == 1
        finally:
            stalled.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: metric(stack.control_metrics_url, "ttserve_worker_stalled", worker="0") == 0
                   and metric(stack.control_metrics_url, "ttserve_worker_ready", worker="0") == 1, 60,
                   "the stalled worker to be taken back")
        client.add("after", PROMPT, 4, eos_token_ids=())
        assert client.collect({"after"})["after"].finish_reason == FINISH.FINISH_REASON_LENGTH
    finally:
        client.close()
        stack.stop()


def test_a_sole_worker_restarted_takes_its_requests_back(tmp_path, smollm2):
    # One row: "queued" waits in the lane's queue while "paused" runs, and is lost waiting.
    stack = start_stack(tmp_path, str(smollm2), gateway=False, worker_flags=WORKER_FLAGS,
                        control_flags=("--max-num-seqs", "1"))
    client = ControlClient(stack.control_address)
    try:
        client.add("reference", PROMPT, MAX_TOKENS, eos_token_ids=())
        reference = client.collect({"reference"})["reference"]
        client.add("paused", PROMPT, MAX_TOKENS, eos_token_ids=())
        client.add("queued", PROMPT[:3], 4, eos_token_ids=())
        head = stream(client, "paused", 8)
        stack.services[0].stop(signal.SIGKILL)
        port = int(stack.worker_address.rsplit(":", 1)[1])
        stack.services[0] = start_worker(tmp_path, str(smollm2), port, *WORKER_FLAGS)  # as Restart= would
        results = client.collect({"paused", "queued"}, timeout=300)
        paused, queued = results["paused"], results["queued"]
        assert paused.finish_reason == FINISH.FINISH_REASON_LENGTH, paused.error
        assert head.token_ids + paused.token_ids == reference.token_ids
        assert queued.finish_reason == FINISH.FINISH_REASON_LENGTH and len(queued.token_ids) == 4
        assert metric(stack.control_metrics_url, "ttserve_request_migrations_total", outcome="requeued") == 2
    finally:
        client.close()
        stack.stop()


@pytest.mark.parametrize("flags, cause", [
    (("--migration-limit", "0"), "not migrated again: it moved 0 time(s) already (--migration-limit 0)"),
    (("--migration-timeout", "2"), "no worker was ready to take the request within --migration-timeout 2 s"),
])
def test_a_request_past_the_migration_bounds_fails_naming_the_cause(tmp_path, smollm2, flags, cause):
    stack = start_stack(tmp_path, str(smollm2), gateway=False, worker_flags=WORKER_FLAGS, control_flags=flags)
    client = ControlClient(stack.control_address)
    try:
        client.add("doomed", PROMPT, 2000, eos_token_ids=())
        head = stream(client, "doomed", 4)
        stack.services[0].stop(signal.SIGKILL)
        result = rest(client, "doomed", head)
        assert result.finish_reason == FINISH.FINISH_REASON_ERROR
        assert "worker 0" in result.error and cause in result.error, result.error
        assert "127.0.0.1" not in result.error  # clients read worker names, not addresses
        outcome = "failed_limit" if "limit" in flags[0] else "failed_timeout"
        wait_until(lambda: metric(stack.control_metrics_url, "ttserve_request_migrations_total",
                                  outcome=outcome) == 1, 10, f"the {outcome} migration to be counted")
    finally:
        client.close()
        stack.stop()


def test_the_http_client_of_a_request_that_cannot_migrate_gets_the_cause(tmp_path, smollm2):
    import openai

    stack = start_stack(tmp_path, str(smollm2), worker_flags=WORKER_FLAGS, control_flags=("--migration-limit", "0"))
    try:
        client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)
        chunks = iter(client.completions.create(model=smollm2.name, prompt="Once upon a time", max_tokens=2000,
                                                stream=True, extra_body={"ignore_eos": True}, timeout=120))
        assert next(chunks).choices
        stack.services[0].stop(signal.SIGKILL)
        with pytest.raises(openai.APIError) as e:
            for _ in chunks:
                pass
        assert "worker 0" in str(e.value) and "--migration-limit 0" in str(e.value), e.value
        assert "127.0.0.1" not in str(e.value)
        assert "Internal server error" not in str(e.value)
    finally:
        stack.stop()


@pytest.mark.parametrize("gateway_flags, cause", [
    (("--control-migration-limit", "0"), ""),
    (("--control-migration-timeout", "2"), "(no control plane was ready within 2 s)"),
], ids=["no-resumption", "none-ready-in-time"])
def test_the_http_client_of_a_request_whose_control_plane_dies_gets_the_cause(tmp_path, smollm2, gateway_flags,
                                                                               cause):
    # A request in flight when its control plane dies and does not come back (or may not be
    # resumed) fails; its client hears why, not a bare 500 (tests/test_e2e_resumption.py: resumed).
    import openai

    stack = start_stack(tmp_path, str(smollm2), worker_flags=("--backend", "sim", "--sim-profile", "t3k-llama-3.3-70b"),
                        gateway_flags=gateway_flags)
    try:
        client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)
        chunks = iter(client.completions.create(model=smollm2.name, prompt="Once upon a time", max_tokens=2000,
                                                stream=True, extra_body={"ignore_eos": True}, timeout=120))
        assert next(chunks).choices
        control = next(s for s in stack.services if s.name == "control")
        control.stop(signal.SIGKILL)
        with pytest.raises(openai.APIError) as e:
            for _ in chunks:
                pass
        assert "lost its session with the control plane" in str(e.value) and cause in str(e.value), e.value
        assert "127.0.0.1" not in str(e.value)
        assert "Internal server error" not in str(e.value)
        assert stack.services[-1].alive()  # the gateway serves on, waiting for its control plane
    finally:
        stack.stop()
