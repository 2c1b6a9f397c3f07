"""Operations end to end on real processes: metrics every service exports (checked by promtool
and scraped by a real Prometheus), readiness, a stalled worker, and graceful drain on SIGTERM
of the control plane and of the worker."""
from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import time
import urllib.parse
from pathlib import Path

import grpc
import pytest

from stack import (DEFAULT_SHUTDOWN_TIMEOUT_S, Service, free_port, get, metric, require_tool, sample,
                   start_stack, wait_until)
from ttserve.control_client import ControlClient, Refused
from ttserve.protocol import CALL_METADATA
from ttserve.v1 import engine_pb2

pytestmark = pytest.mark.e2e

FINISH = engine_pb2.FinishReason
# What the stall tests give the control plane as --stall-timeout.
STALL_TIMEOUT_S = 3


def first_tokens(client: ControlClient, request_id: str) -> list[int]:
    """Wait until `request_id` is admitted and producing; the tokens seen so far."""
    while True:
        message = client.next()
        if message.HasField("admission"):
            assert message.admission.verdict == engine_pb2.Admission.VERDICT_ACCEPTED, message
            continue
        for out in message.outputs.outputs:
            if out.request_id == request_id and out.new_token_ids:
                return list(out.new_token_ids)


def refusal_and_tokens(client: ControlClient, refused_id: str, running_id: str
                       ) -> tuple[engine_pb2.Admission, list[int]]:
    """Read the session up to `refused_id`'s admission verdict; the verdict, and the tokens of
    `running_id` published meanwhile (which ControlClient.collect would drop as another id's)."""
    tokens: list[int] = []
    while True:
        message = client.next(10)
        if message.HasField("admission"):
            if message.admission.request_id == refused_id:
                return message.admission, tokens
            continue
        tokens += [t for out in message.outputs.outputs if out.request_id == running_id for t in out.new_token_ids]


@contextlib.contextmanager
def engine_stack(tmp_path: Path, model: Path, **flags):
    """Worker and control plane (no gateway), and a client of the control plane."""
    stack = start_stack(tmp_path, str(model), gateway=False, **flags)
    client = ControlClient(stack.control_address)
    try:
        yield stack, client
    finally:
        client.close()
        stack.stop()


# ---- metrics, scraped by a real Prometheus ---------------------------------------------------
@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm2):
    s = start_stack(tmp_path_factory.mktemp("ops"), str(smollm2))
    yield s
    s.stop()


def test_every_service_exports_metrics_that_promtool_accepts(stack):
    promtool = require_tool("promtool")
    from openai import OpenAI

    client = OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    # ignore_eos: the finish reason is "length" whatever the bf16 model says first.
    client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                              extra_body={"ignore_eos": True})
    for url in (stack.control_metrics_url, *stack.worker_metrics_urls, stack.http_url):
        status, text = get(f"{url}/metrics")
        assert status == 200
        check = subprocess.run([promtool, "check", "metrics"], input=text, text=True, capture_output=True)
        assert check.returncode == 0, f"{url}/metrics:\n{check.stdout}{check.stderr}"
    control = get(f"{stack.control_metrics_url}/metrics")[1]
    assert sample(control, "ttserve_request_success_total", finished_reason="length") >= 1
    assert sample(control, "ttserve_generation_tokens_total", worker="0") >= 4
    assert sample(control, "ttserve_time_to_first_token_seconds_count") >= 1
    assert sample(control, "ttserve_steps_total", worker="0", kind="decode", execution="eager") >= 3
    assert sample(control, "ttserve_worker_ready", worker="0") == 1
    assert sample(control, "ttserve_num_requests_running", worker="0", lane="0") == 0
    worker = get(f"{stack.worker_metrics_urls[0]}/metrics")[1]
    assert sample(worker, "ttserve_device_ready") == 1
    assert sample(worker, "ttserve_device_steps_total", kind="prefill", execution="eager") >= 1
    for url in (stack.control_metrics_url, *stack.worker_metrics_urls):
        assert get(f"{url}/health") == (200, '{"ok": true}\n')
        assert get(f"{url}/ready") == (200, '{"ok": true}\n')
        assert get(f"{url}/nothing")[0] == 404


DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"


def shipped_config_for(stack) -> dict:
    """deploy/prometheus/prometheus.yml as shipped, pointed at this stack's services, with its
    rule files by absolute path and a 1 s scrape and evaluation interval."""
    import yaml

    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(DEPLOY / name) for name in config["rule_files"]]
    live = {"ttserve-gateway": [stack.http_url], "ttserve-control": [stack.control_metrics_url],
            "ttserve-worker": stack.worker_metrics_urls}
    for job in config["scrape_configs"]:
        urls = live.pop(job["job_name"])
        if urls[0].startswith("http://"):
            # This stack's gateway is plaintext without a key; the shipped HTTPS-and-key settings
            # are scraped for real by test_e2e_security.py.
            for key in ("scheme", "tls_config", "authorization"):
                job.pop(key, None)
        job["static_configs"] = [
            {"targets": [url.split("//")[1]], "labels": {**static.get("labels", {})}}
            for url, static in zip(urls, job["static_configs"])]
    assert not live, f"the shipped config has no job for {sorted(live)}"
    return config


def test_prometheus_with_the_shipped_config_scrapes_all_three_services_and_evaluates_every_rule(
        stack, tmp_path):
    prometheus = require_tool("prometheus")
    from openai import OpenAI

    client = OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    before = metric(stack.control_metrics_url, "ttserve_request_success_total", finished_reason="length") or 0
    for _ in range(2):
        client.completions.create(model=model, prompt="One, two,", max_tokens=3)
    config = shipped_config_for(stack)
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    server = Service("prometheus", [], tmp_path / "prometheus.log")
    server.log = open(server.log_path, "ab")
    server.proc = subprocess.Popen(
        [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"], stdout=server.log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api/v1"

    def query(expr: str) -> list[dict]:
        status, body = get(f"{api}/query?{urllib.parse.urlencode({'query': expr})}")
        assert status == 200, body
        return json.loads(body)["data"]["result"]

    def rules() -> list[dict]:
        status, body = get(f"{api}/rules")
        assert status == 200, body
        return [rule for group in json.loads(body)["data"]["groups"] for rule in group["rules"]]

    try:
        jobs = {job["job_name"] for job in config["scrape_configs"]}
        wait_until(lambda: {r["metric"]["job"] for r in query("up == 1")} == jobs, 60,
                   "Prometheus to scrape all three services")
        wait_until(lambda: float(query('sum(ttserve_request_success_total{finished_reason="length"})')
                                 [0]["value"][1]) >= before + 2, 30, "the request counter in Prometheus")
        assert query("ttserve_gateway_control_plane_connected")[0]["value"][1] == "1"
        assert query('ttserve_device_ready{worker="0"}')[0]["value"][1] == "1"  # the label joins
        assert query('ttserve_worker_up{worker="0"}')[0]["value"][1] == "1"
        # Every shipped recording and alerting rule evaluates on the real series, and no alert
        # fires on a healthy stack.
        wait_until(lambda: all(rule.get("lastEvaluation", "").startswith("2") and
                               not rule["lastEvaluation"].startswith("0001") for rule in rules()),
                   30, "every rule to be evaluated")
        broken = [(rule["name"], rule.get("lastError")) for rule in rules() if rule["health"] != "ok"]
        assert not broken
        wait_until(lambda: query("ttserve:generation_tokens:rate5m"), 30, "a recorded token rate")
        assert query('ttserve:num_requests_running:sum')
        firing = [a["labels"]["alertname"] for rule in rules() if rule["type"] == "alerting"
                  for a in rule.get("alerts", []) if a["state"] == "firing"]
        assert not firing
    finally:
        server.stop()


# ---- a stalled worker --------------------------------------------------------------------------
def test_a_stalled_workers_requests_wait_for_it_and_finish_when_it_is_back(tmp_path, smollm2):
    stall_timeout = ("--stall-timeout", str(STALL_TIMEOUT_S))
    with engine_stack(tmp_path, smollm2, control_flags=stall_timeout) as (stack, client):
        worker = stack.services[0]
        control_metrics = stack.control_metrics_url
        client.add("slow", [1, 2, 3, 4], 40, eos_token_ids=())
        seen = first_tokens(client, "slow")
        # A slow step on a busy machine may count as a stall of its own: count from a moment when
        # the worker is not stalled, so that the next stall is the one this test causes.
        wait_until(lambda: metric(control_metrics, "ttserve_worker_stalled", worker="0") == 0, 60,
                   "the worker not to be stalled before the test stalls it", stack)
        wait_until(lambda: client.server_info().ready, 60, "the worker to serve again", stack)
        stalls = metric(control_metrics, "ttserve_worker_stalls_total", worker="0") or 0
        worker.proc.send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: metric(control_metrics, "ttserve_worker_stalled", worker="0") == 1,
                       STALL_TIMEOUT_S + 30, "the stall to be reported")
            info = client.server_info()
            assert info.workers[0].stalled and info.workers[0].state.startswith("stalled")
            assert not info.ready  # its only worker is stalled
            status, body = get(f"{control_metrics}/ready")
            assert status == 503 and "stalled" in json.loads(body)["reason"]
            client.add("newcomer", [1, 2, 3], 4)  # refused at once, not queued behind the stall
            refusal, published = refusal_and_tokens(client, "newcomer", "slow")
            assert refusal.verdict != engine_pb2.Admission.VERDICT_ACCEPTED
            assert re.search("no worker is ready.*stalled", refusal.message), refusal.message
            seen += published  # tokens of steps applied before the worker stopped
            assert metric(control_metrics, "ttserve_worker_stalls_total", worker="0") >= stalls + 1
        finally:
            worker.proc.send_signal(signal.SIGCONT)
        # Its request migrated off the stalled link and waits (no other worker) until the worker
        # answers again; then it recomputes there and finishes, nothing lost or doubled.
        result = client.collect({"slow"})["slow"]
        assert result.finish_reason == FINISH.FINISH_REASON_LENGTH and len(seen + result.token_ids) == 40
        assert metric(control_metrics, "ttserve_worker_stalled", worker="0") == 0
        assert metric(control_metrics, "ttserve_request_migrations_total", outcome="requeued") >= 1
        assert client.server_info().ready
        log = stack.services[1].output()
        assert f"stalled: no step result for {STALL_TIMEOUT_S} s" in log
        assert "after it stalled" in log


# ---- graceful drain ----------------------------------------------------------------------------
def test_sigterm_lets_the_control_plane_finish_what_it_holds_and_refuse_the_rest(tmp_path, smollm2):
    with engine_stack(tmp_path, smollm2) as (stack, client):
        control = stack.services[1]
        client.add("held", [1, 2, 3, 4], 48, eos_token_ids=())
        seen = first_tokens(client, "held")
        control.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: client.server_info().draining, 10, "the control plane to drain")
        info = client.server_info()
        assert not info.ready
        status, body = get(f"{stack.control_metrics_url}/ready")
        assert status == 503 and "shutting down" in body
        client.add("late", [1, 2, 3], 4)
        with pytest.raises(Refused, match="shutting down"):
            client.collect({"late"})
        newcomer = ControlClient(stack.control_address)  # a new session is refused outright
        try:
            with pytest.raises(grpc.RpcError) as refused:
                newcomer.stub.Session(iter([]), metadata=CALL_METADATA).next()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in refused.value.details()
        finally:
            newcomer.close()
        result = client.collect({"held"})["held"]
        assert (result.finish_reason, len(seen + result.token_ids)) == (FINISH.FINISH_REASON_LENGTH, 48)
        assert control.proc.wait(timeout=30) == 0
        assert "request_finished id=\"held\"" in control.output()
        assert "Traceback" not in control.output()


def test_past_the_shutdown_timeout_the_rest_is_aborted_with_a_reason(tmp_path, smollm2):
    with engine_stack(tmp_path, smollm2, control_flags=("--shutdown-timeout", "1")) as (stack, client):
        control = stack.services[1]
        client.add("long", [1, 2, 3, 4], 2000, eos_token_ids=())
        first_tokens(client, "long")
        started = time.monotonic()
        control.proc.send_signal(signal.SIGTERM)
        result = client.collect({"long"}, timeout=60)["long"]
        assert result.finish_reason == FINISH.FINISH_REASON_ABORT
        assert "shut down" in result.error and "--shutdown-timeout 1" in result.error
        assert 0 < len(result.token_ids) < 2000
        assert control.proc.wait(timeout=30) == 0
        # --shutdown-timeout 1 cut the drain short: well before the default timeout would have.
        assert time.monotonic() - started < DEFAULT_SHUTDOWN_TIMEOUT_S - 5


def test_sigterm_on_the_worker_lets_the_control_plane_step_then_exits_cleanly(tmp_path, smollm2):
    with engine_stack(tmp_path, smollm2, worker_flags=("--shutdown-timeout", "3"),
                      control_flags=("--migration-timeout", "3")) as (stack, client):
        worker = stack.services[0]
        client.add("long", [1, 2, 3, 4], 2000, eos_token_ids=())
        first_tokens(client, "long")
        worker.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        wait_until(lambda: get(f"{stack.worker_metrics_urls[0]}/health")[0] == 503, 10,
                   "the worker to report draining")
        assert get(f"{stack.worker_metrics_urls[0]}/ready")[0] == 503
        result = client.collect({"long"}, timeout=60)["long"]
        # It kept stepping through the drain window, then went away; no other worker came to take
        # the request within --migration-timeout: it says so.
        assert time.monotonic() - signalled >= 2.5
        assert result.finish_reason == FINISH.FINISH_REASON_ERROR and "worker" in result.error
        assert "--migration-timeout 3 s" in result.error
        assert worker.proc.wait(timeout=30) == 0
