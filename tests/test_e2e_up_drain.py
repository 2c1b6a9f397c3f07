"""`ttserve up` stopped from a terminal: Ctrl-C lets the gateway's streams finish, and a second
Ctrl-C cuts that drain short."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import openai
import pytest

from stack import free_port, http_ok, wait_until

pytestmark = pytest.mark.e2e

# The simulated T3K's step time (~63 ms a token, no arithmetic) makes a stream's length in time
# independent of how busy the host is: 60 tokens take ~4 s, 1000 over a minute.
SIM_WORKER = ("--backend", "sim", "--sim-profile", "t3k-llama-3.3-70b")
SHORT_TOKENS, LONG_TOKENS = 60, 1000
# The stream the worker is killed under: ~1.2 s of tokens left after its first, far more than the
# moment the kill takes, so it is in flight when the worker dies (the test checks it moved).
RESTART_TOKENS = 20


def start_up(tmp_path, model) -> tuple[subprocess.Popen, str, object]:
    """`ttserve up` on the simulated worker, on free ports; (process, gateway URL, log path)."""
    ports = [free_port() for _ in range(5)]
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        # A process group of its own, as a shell gives a foreground job: killpg then signals what
        # a terminal's Ctrl-C signals.
        proc = subprocess.Popen([sys.executable, "-m", "ttserve.cli", "up", "--port", str(ports[0]),
                                 "--control-port", str(ports[1]), "--worker-port", str(ports[2]),
                                 "--control-metrics-port", str(ports[3]),
                                 "--worker-metrics-port", str(ports[4]), "--model", str(model),
                                 *SIM_WORKER], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{ports[0]}", log_path


def stop_up(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()  # up stops its services, which are out of its process group
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def start_stream(url: str, model: str, max_tokens: int):
    """A streamed completion of exactly `max_tokens` unless cut short, its first chunk read."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    chunks = iter(client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, timeout=120))
    first = next(chunks)
    assert first.choices and first.choices[0].finish_reason is None
    return chunks


def finish(chunks, timeout: float = 60) -> tuple[list[str], int]:
    """The rest of a stream: its finish reasons and its completion token count."""
    rest: list = []
    # Read on a thread so that a stream left hanging fails the test instead of blocking it.
    reader = threading.Thread(target=lambda: rest.extend(chunks), daemon=True)
    reader.start()
    reader.join(timeout)
    assert not reader.is_alive(), "the stream was left hanging"
    reasons = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in rest if c.usage]
    return reasons, usage[-1].completion_tokens if usage else 0


@pytest.fixture(scope="module")
def up(tmp_path_factory, smollm2):
    """One `ttserve up` for the module's tests, ready: the restart test leaves it serving, and the
    Ctrl-C test, last, stops it. (process, gateway URL, log path)"""
    proc, url, log_path = start_up(tmp_path_factory.mktemp("up"), smollm2)
    try:
        wait_until(lambda: http_ok(f"{url}/ready"), 300, "ttserve up")
        yield proc, url, log_path
    finally:
        stop_up(proc)


def test_up_restarts_a_killed_worker_and_the_stream_in_flight_completes(up, smollm2):
    """As an operator's SIGKILL (or a crash) would: the worker dies under a streaming request, up
    restarts it, the control plane moves the request onto it, and the HTTP client sees a pause."""
    proc, url, log_path = up
    stream = start_stream(url, smollm2.name, RESTART_TOKENS)
    worker = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "ttserve.worker"], capture_output=True,
                            text=True).stdout.split()
    assert len(worker) == 1, worker
    os.kill(int(worker[0]), signal.SIGKILL)
    reasons, tokens = finish(stream, timeout=120)
    output = log_path.read_text()
    assert (reasons, tokens) == (["length"], RESTART_TOKENS), output[-4000:]
    assert "worker exited with code -9; restarting it in 1 s" in output and "worker restarted" in output
    # It was in flight on the killed worker: it finished on the restarted one, moved once.
    assert re.search(rf"request_finished .* generated_tokens={RESTART_TOKENS} .* migrations=1 ", output), \
        output[-4000:]
    assert proc.poll() is None  # the stack stayed up
    wait_until(lambda: http_ok(f"{url}/ready"), 60, "ttserve up to be ready again")


def test_ctrl_c_drains_the_streams_in_flight_and_a_second_one_aborts_the_rest(up, smollm2):
    proc, url, log_path = up
    short = start_stream(url, smollm2.name, SHORT_TOKENS)
    long = start_stream(url, smollm2.name, LONG_TOKENS)
    os.killpg(proc.pid, signal.SIGINT)
    assert finish(short) == (["length"], SHORT_TOKENS), log_path.read_text()[-4000:]
    assert proc.poll() is None  # still draining the long stream
    os.killpg(proc.pid, signal.SIGINT)
    reasons, tokens = finish(long)
    assert reasons == ["abort"] and tokens < LONG_TOKENS, log_path.read_text()[-4000:]
    assert proc.wait(timeout=60) == 0, log_path.read_text()[-4000:]
    assert "Traceback" not in log_path.read_text()
