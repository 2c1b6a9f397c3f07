"""Per-key names and rate limits through a real gateway: a keys file with a rate-limited key and
an unlimited one; the limited key's third request within a minute gets 429 with Retry-After
before it reaches the control plane, the other key is still served, and /metrics counts both by
name and never shows a key."""
from __future__ import annotations

import concurrent.futures
import shutil
import subprocess

import httpx
import pytest

from stack import get, metric, sample, start_stack, wait_until

pytestmark = pytest.mark.e2e

SIM_WORKER = ("--backend", "sim", "--sim-profile", "t3k-llama-3.3-70b")
KEY_A, KEY_B = "sk-alpha-0123456789abcdef", "sk-bravo-fedcba9876543210"
KEY_C = "sk-charlie-5555aaaa6666bbbb"
QUEUE = 3  # --max-num-queued-reqs: with one row, each tenant may hold 2 live requests (0.5 of 1 + 3)
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def limited(tmp_path_factory, smollm2):
    tmp = tmp_path_factory.mktemp("key-limits")
    key_file = tmp / "api-keys"
    key_file.write_text(f"# rate-limited and not\na: {KEY_A} rpm=2\nb: {KEY_B}\nc: {KEY_C}\n")
    key_file.chmod(0o600)
    stack = start_stack(tmp, str(smollm2), worker_flags=SIM_WORKER,
                        control_flags=("--max-num-seqs", "1", "--max-num-queued-reqs", str(QUEUE),
                                       "--tenant-queue-share", "0.5"),
                        gateway_flags=("--api-key-file", str(key_file), "--key-tokens-per-minute", "1000000"))
    try:
        # /health answers while the gateway still starts vLLM's frontend; /ready once it serves.
        wait_until(lambda: httpx.get(f"{stack.http_url}/ready", headers=auth(KEY_B), timeout=2).status_code == 200,
                   300, "the gateway to serve", stack)
        yield stack
    finally:
        stack.stop()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_key_over_its_request_rate_gets_429_while_another_key_is_served(limited, smollm2):
    url = limited.http_url
    body = {"model": smollm2.name, "prompt": "The capital of France is", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    chat = {"model": smollm2.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": MAX_TOKENS,
            "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=60) as http:
        first = http.post("/v1/completions", json=body, headers=auth(KEY_A))
        second = http.post("/v1/chat/completions", json={**chat, "stream": True}, headers=auth(KEY_A))
        third = http.post("/v1/chat/completions", json=chat, headers=auth(KEY_A))  # within 30 s: refused
        other = http.post("/v1/completions", json=body, headers=auth(KEY_B))
        metrics = http.get("/metrics", headers=auth(KEY_B)).text
    assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == MAX_TOKENS, first.text
    assert second.status_code == 200 and "data: [DONE]" in second.text, second.text
    assert third.status_code == 429, third.text
    assert 1 <= int(third.headers["retry-after"]) <= 30  # rpm=2: one request back every 30 s
    error = third.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert "'a'" in error["message"] and "requests per minute" in error["message"]
    assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] == MAX_TOKENS, other.text

    assert sample(metrics, "ttserve_gateway_key_requests_total", key="a") == 3
    assert sample(metrics, "ttserve_gateway_key_requests_total", key="b") == 1
    assert sample(metrics, "ttserve_gateway_rate_limited_total", key="a", limit="requests") == 1
    assert sample(metrics, "ttserve_gateway_rate_limited_total", key="b", limit="requests") == 0
    prompt_b = other.json()["usage"]["prompt_tokens"]
    assert sample(metrics, "ttserve_gateway_key_tokens_total", key="b", kind="prompt") == prompt_b
    assert sample(metrics, "ttserve_gateway_key_tokens_total", key="b", kind="generation") == MAX_TOKENS
    assert sample(metrics, "ttserve_gateway_key_tokens_total", key="a", kind="generation") == 2 * MAX_TOKENS
    assert KEY_A not in metrics and KEY_B not in metrics
    assert KEY_A[:8] not in metrics and KEY_B[:8] not in metrics  # not even a prefix
    if promtool := shutil.which("promtool"):  # test_e2e_ops.py requires it for the metrics without keys
        check = subprocess.run([promtool, "check", "metrics"], input=metrics, text=True, capture_output=True)
        assert check.returncode == 0, check.stdout + check.stderr


def test_a_tenant_flooding_the_queue_gets_503_while_another_tenant_is_admitted(limited, smollm2):
    """One row: key b's requests queue behind each other. Past its share (half of the row and the
    3 queue places: 2 live requests) b is refused with 503 and Retry-After, and key c is still
    admitted and served."""
    body = {"model": smollm2.name, "prompt": "Count to one hundred:", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True}
    control = limited.control_metrics_url
    with httpx.Client(base_url=limited.http_url, timeout=120) as http, \
            concurrent.futures.ThreadPoolExecutor(6) as pool:
        flood = [pool.submit(http.post, "/v1/completions", json=body, headers=auth(KEY_B)) for _ in range(6)]
        wait_until(lambda: metric(control, "ttserve_num_requests_waiting", worker="0", lane="0") == 1, 60,
                   "b's share of the queue to fill", limited)
        other = http.post("/v1/completions", json={**body, "max_tokens": 4}, headers=auth(KEY_C))
        replies = [f.result() for f in flood]
    assert other.status_code == 200, other.text
    refused = [r for r in replies if r.status_code == 503]
    assert refused and all(r.status_code in (200, 503) for r in replies), [r.text for r in replies]
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert "tenant 'b' already has 2 requests, its share" in refused[0].json()["error"]["message"]
    assert sample(get(f"{control}/metrics")[1], "ttserve_requests_refused_total", reason="overloaded") == len(refused)
