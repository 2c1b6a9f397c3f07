"""Workers join, drain and leave while the control plane serves, and none of it loses a request:
a rolling restart of every worker under a steady greedy load, a worker added and removed through
--workers-file, and an incompatible worker refused alone. Real processes on loopback ports."""
from __future__ import annotations

import signal
import time

import pytest

from stack import Service, control_ready, free_port, metric, start_stack, start_worker, wait_until
from steady_load import PROMPTS, SteadyLoad
from ttserve.control_client import ControlClient

pytestmark = pytest.mark.e2e

# Long enough that every request is in flight over many steps (a worker leaving always holds
# some mid-stream), short enough that the load's phases pass quickly.
MAX_TOKENS = 16
# fp32: a recomputed prefill and the decode steps it replaces agree to the last bit far more
# often than in bf16, so the greedy oracle holds across a move (test_e2e_migration.py).
WORKER_FLAGS = ("--dtype", "float32", "--num-threads", "1")


def restart(service: Service) -> Service:
    """The same worker started again, as its supervisor (systemd, Kubernetes) would."""
    return Service(service.name, service.args, service.log_path).start()


def test_a_rolling_restart_of_both_workers_under_load_loses_nothing(tmp_path, smollm2):
    stack = start_stack(tmp_path, str(smollm2), gateway=False, workers=2, worker_flags=WORKER_FLAGS)
    client = ControlClient(stack.control_address)
    load = SteadyLoad(client, PROMPTS, MAX_TOKENS, concurrency=4)
    try:
        references = load.references()
        load.start()
        wait_until(lambda: load.finished() >= 2, 120, "the load to run")
        for i in (0, 1):
            # SIGTERM: the worker tells the control plane, which moves its requests to the other
            # worker and lets it go; it exits 0 well before its --shutdown-timeout.
            assert stack.services[i].stop(signal.SIGTERM, timeout=60) == 0, stack.logs()
            stack.services[i] = restart(stack.services[i])
            wait_until(lambda: control_ready(stack.control_address), 180, f"worker {i} to be back", stack)
            done = load.finished()
            wait_until(lambda: load.finished() >= done + 4, 120, "the load to go on", stack)
        outcome = load.stop()
        assert not outcome.mismatches(references), outcome.mismatches(references)
        assert len(outcome.results) >= 12
        url = stack.control_metrics_url
        assert metric(url, "ttserve_request_migrations_total", outcome="handed_off") >= 1
        for failed in ("failed_limit", "failed_timeout"):
            assert metric(url, "ttserve_request_migrations_total", outcome=failed) == 0
        assert "is shutting down" in stack.services[2].output()
    finally:
        client.close()
        stack.stop()


def test_workers_join_and_leave_through_the_workers_file_and_an_incompatible_one_is_refused_alone(
        tmp_path, smollm2):
    a, b, c = (start_worker(tmp_path, str(smollm2), None, *WORKER_FLAGS, *extra)
               for extra in ((), ("--block-size", "32"), ()))
    workers = {"a": a, "b": b, "c": c}
    address = {name: f"127.0.0.1:{w.args[w.args.index('--port') + 1]}" for name, w in workers.items()}
    listed = tmp_path / "workers"
    listed.write_text(f"# the control plane's workers\na={address['a']}\n")
    port, metrics_port = free_port(), free_port()
    control = Service("control", ["ttserve.control", "--port", str(port), "--metrics-port", str(metrics_port),
                                  "--workers-file", str(listed)], tmp_path / "control.log").start()
    services = [a, b, c, control]
    url = f"http://127.0.0.1:{metrics_port}"
    client = None

    def states() -> dict[str, str]:
        return {w.name: w.state for w in client.server_info().workers}

    try:
        wait_until(lambda: control_ready(f"127.0.0.1:{port}"), 180, "worker a to serve")
        client = ControlClient(f"127.0.0.1:{port}")
        assert states() == {"a": "serving"}
        # b keeps KV blocks of 32 tokens against a's 64: refused alone, a serves on.
        listed.write_text(f"a={address['a']}\nb={address['b']}\n")
        wait_until(lambda: states().get("b", "").startswith("refused"), 180, "worker b to be refused")
        assert "KV blocks of 32 tokens" in states()["b"] and states()["a"] == "serving"
        assert client.server_info().ready and control.alive()
        # b leaves, c joins (a SIGHUP re-reads at once instead of at the next poll).
        listed.write_text(f"a={address['a']}\nc={address['c']}\n")
        control.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: states() == {"a": "serving", "c": "serving"}, 180, "worker c to join")
        assert metric(url, "ttserve_worker_ready", worker="c") == 1

        load = SteadyLoad(client, PROMPTS, MAX_TOKENS, concurrency=4)
        references = load.references()
        load.start()
        wait_until(lambda: load.finished() >= 4, 120, "the load to run")
        listed.write_text(f"c={address['c']}\n")  # a leaves under load: its requests move to c
        wait_until(lambda: set(states()) == {"c"}, 60, "worker a to be removed")
        done = load.finished()
        wait_until(lambda: load.finished() >= done + 4, 120, "the load to go on")
        outcome = load.stop()
        assert not outcome.mismatches(references), outcome.mismatches(references)
        assert metric(url, "ttserve_request_migrations_total", outcome="failed_limit") == 0
        assert "removed (no longer in --workers-file)" in control.output()
        # A file that no longer parses keeps the worker set as it is.
        listed.write_text("c=not an address\n")
        control.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "the worker set stays as it is" in control.output(), 30, "the bad file to be refused")
        assert states() == {"c": "serving"}
    finally:
        if client is not None:
            client.close()
        for service in reversed(services):
            service.stop()


def test_a_new_control_plane_takes_over_a_worker_whose_control_plane_vanished(tmp_path, smollm2):
    """SIGSTOP: the old control plane's connection stays open and nothing answers on it, as when
    its host loses power or is cut off. The worker's keepalive finds it dead and ends its step
    stream, and a new control plane (authenticated the same way) takes the worker over."""
    worker = start_worker(tmp_path, str(smollm2), None, *WORKER_FLAGS)
    address = f"127.0.0.1:{worker.args[worker.args.index('--port') + 1]}"
    controls = []

    def control() -> tuple[Service, str]:
        port = free_port()
        controls.append(Service("control", ["ttserve.control", "--port", str(port), "--metrics-port", "0",
                                            "--worker", f"w={address}"], tmp_path / f"control-{port}.log").start())
        return controls[-1], f"127.0.0.1:{port}"

    try:
        old, old_address = control()
        wait_until(lambda: control_ready(old_address), 180, "the first control plane to serve")
        old.proc.send_signal(signal.SIGSTOP)
        _, new_address = control()
        started = time.monotonic()
        wait_until(lambda: control_ready(new_address), 120, "the new control plane to take the worker over")
        # Within the worker's keepalive window (ping every 20 s, 10 s to answer) plus a reconnect.
        assert time.monotonic() - started < 60
        client = ControlClient(new_address)
        try:
            client.add("after", PROMPTS[0], 8, eos_token_ids=())
            assert len(client.collect({"after"})["after"].token_ids) == 8
        finally:
            client.close()
    finally:
        for service in controls:
            service.stop(signal.SIGKILL)
        worker.stop()
