"""Workers join, drain and leave while the control plane serves, and none of it loses a request:
a rolling restart of every worker under a steady greedy load, a worker added and removed through
--workers-file, and an incompatible worker refused alone. Real processes on loopback ports."""
from __future__ import annotations

import signal

import pytest

from stack import Service, control_ready, free_port, metric, start_stack, start_worker, wait_until
from steady_load import SteadyLoad
from ttserve.control_client import ControlClient

pytestmark = pytest.mark.e2e

# Any fixed ids: greedy decoding makes every run of a prompt reproducible.
PROMPTS = [[1, 9690, 314, 253, 1932, 30, 2], [1, 4093, 282, 260, 3575, 284, 2], [1, 504, 3458, 28, 2]]
MAX_TOKENS = 40
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
