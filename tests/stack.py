"""Real services on loopback ports for the end-to-end tests: processes, ports, readiness, logs."""
from __future__ import annotations

import contextlib
import itertools
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from ttserve.protocol import CALL_METADATA
from ttserve.v1 import engine_pb2, engine_pb2_grpc


# The default --shutdown-timeout of every service (docs/metrics.md, "Graceful drain"). A drain cut
# short by a smaller --shutdown-timeout must end well before it.
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0

# CI sets TTSERVE_REQUIRE_OPS_TOOLS=1: a missing ops tool (promtool, prometheus, systemd-analyze,
# docker-compose) then fails the test that needs it instead of skipping it.
REQUIRE_OPS_TOOLS = os.environ.get("TTSERVE_REQUIRE_OPS_TOOLS") == "1"
OPS_TOOLS_HINT = "apt-get install prometheus docker-compose systemd kubernetes-client iproute2"


def require_tool(name: str) -> str:
    """The tool's path; skips (or, with TTSERVE_REQUIRE_OPS_TOOLS=1, fails) when it is missing."""
    path = shutil.which(name)
    if path:
        return path
    message = f"{name} is not installed ({OPS_TOOLS_HINT})"
    if REQUIRE_OPS_TOOLS:
        pytest.fail(f"{message}; TTSERVE_REQUIRE_OPS_TOOLS=1 requires it")
    pytest.skip(message)


def get(url: str, timeout: float = 10) -> tuple[int, str]:
    """HTTP GET: the status and the body, for error statuses too."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def samples(metrics_text: str, name: str, **labels: str) -> Iterator[float]:
    """The values of the samples of `name` in Prometheus text format whose labels include
    `labels` (matched as a subset), in order."""
    for line in metrics_text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{(.*)\})? (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(3) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            yield float(match.group(4))


def sample(metrics_text: str, name: str, **labels: str) -> float | None:
    """The value of the first matching sample (`samples`); None when no sample matches."""
    return next(samples(metrics_text, name, **labels), None)


def metric(url: str, name: str, **labels: str) -> float | None:
    """One sample of the /metrics that the server at `url` serves."""
    return sample(get(f"{url}/metrics")[1], name, **labels)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (what bind(0) and outgoing connections get)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _xdist_ports() -> Iterator[int] | None:
    """Under pytest-xdist (`-n N`), this worker's own block of ports, none of them in the ephemeral
    range: bind(0) would let two workers pick the same port between the check and the service's
    own bind (and gRPC binds with SO_REUSEPORT, so both services would start and share it). The
    block's ports are handed out in turn from a random start, so a concurrent run elsewhere on
    the machine that took the same block rarely meets this one. None outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return None
    index, count = int(worker[2:]), max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
    low, high = 10000, max(_ephemeral_low(), 12000)
    size = (high - low) // max(count, index + 1)
    block = range(low + index * size, low + (index + 1) * size)
    start = random.SystemRandom().randrange(len(block))  # not the (maybe seeded) module state
    return itertools.cycle([*block[start:], *block[:start]])


_PORTS = _xdist_ports()


def free_port() -> int:
    """A loopback port nothing listens on now (for a service to bind)."""
    for _ in range(1000 if _PORTS is not None else 0):
        port = next(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    name: str
    args: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self, env: dict | None = None) -> "Service":
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", *self.args], stdout=self.log,
                                     stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class Stack:
    services: list[Service] = field(default_factory=list)
    http_url: str = ""
    control_address: str = ""
    worker_address: str = ""
    # http://host:port of the control plane's and each worker's metrics/health server.
    control_metrics_url: str = ""
    worker_metrics_urls: list[str] = field(default_factory=list)
    # Standby control planes over the same workers (start_stack standby_controls), as
    # (gRPC address, metrics URL), listed after control_address in the gateway's --control.
    standbys: list[tuple[str, str]] = field(default_factory=list)

    def logs(self) -> str:
        return "\n".join(f"--- {s.name} ---\n{s.output()[-4000:]}" for s in self.services)

    def stop(self) -> None:
        for service in reversed(self.services):
            service.stop()


def wait_until(check, timeout: float, what: str, stack: Stack | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stack is not None:
            dead = [s for s in stack.services if not s.alive()]
            if dead:
                raise AssertionError(f"{dead[0].name} exited while waiting for {what}\n{stack.logs()}")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n"
                         + (stack.logs() if stack else ""))


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as r:
        return r.status == 200


def control_ready(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        info = engine_pb2_grpc.EngineStub(channel).GetServerInfo(
            engine_pb2.ServerInfoRequest(), metadata=CALL_METADATA, timeout=2)
        return info.ready and all(w.ready for w in info.workers)


def start_worker(tmp: Path, model: str, port: int | None = None, *extra: str,
                 env: dict | None = None) -> Service:
    """`env`: variables added to the worker's environment."""
    port = port or free_port()
    if "--metrics-port" not in extra:
        extra = ("--metrics-port", str(free_port()), *extra)
    return Service("worker", ["ttserve.worker", "--port", str(port), "--model", model, *extra],
                   tmp / f"worker-{port}.log").start(env)


def start_stack(tmp: Path, model: str, *, control_flags: tuple[str, ...] = (),
                worker_flags: tuple[str, ...] = (), gateway: bool = True, workers: int = 1,
                gateway_flags: tuple[str, ...] = (), standby_controls: int = 0,
                env: dict | None = None) -> Stack:
    """Workers, a control plane and (optionally) a gateway, each its own process; `env`: variables
    added to every service's environment. `standby_controls`: more control planes over the same
    workers, started once the first is ready (so that it holds the workers), and listed after it
    in the gateway's --control."""
    control_port, control_metrics = free_port(), free_port()
    worker_ports = [free_port() for _ in range(workers)]
    worker_metrics = [free_port() for _ in range(workers)]
    stack = Stack(control_address=f"127.0.0.1:{control_port}",
                  worker_address=f"127.0.0.1:{worker_ports[0]}",
                  control_metrics_url=f"http://127.0.0.1:{control_metrics}",
                  worker_metrics_urls=[f"http://127.0.0.1:{p}" for p in worker_metrics],
                  standbys=[(f"127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}")
                            for _ in range(standby_controls)])
    for port, metrics in zip(worker_ports, worker_metrics):
        stack.services.append(start_worker(tmp, model, port, "--metrics-port", str(metrics),
                                           *worker_flags, env=env))
    # Named by position: the `worker` label the tests' metric queries use.
    worker_args = [arg for i, port in enumerate(worker_ports) for arg in ("--worker", f"{i}=127.0.0.1:{port}")]
    def control(port: str, metrics: str) -> Service:
        return Service("control", ["ttserve.control", "--port", port, "--metrics-port", metrics, *worker_args,
                                   *control_flags], tmp / f"control-{port}.log").start(env)

    stack.services.append(control(str(control_port), str(control_metrics)))
    # The gateway starts beside the workers, as under `ttserve up`: it imports vLLM while they
    # warm up and waits for the control plane (its --connect-timeout and --ready-timeout default
    # to no limit); /ready then means it holds a session with a ready control plane.
    if gateway:
        http_port = free_port()
        stack.http_url = f"http://127.0.0.1:{http_port}"
        stack.services.append(Service("gateway", ["ttserve.gateway", "--port", str(http_port), "--control",
                                                  ",".join([stack.control_address, *(a for a, _ in stack.standbys)]),
                                                  *gateway_flags],
                                      tmp / f"gateway-{http_port}.log").start(env))
    try:
        wait_until(lambda: control_ready(stack.control_address), 300, "the control plane to be ready", stack)
        for address, metrics_url in stack.standbys:
            stack.services.append(control(address.rpartition(":")[2], metrics_url.rpartition(":")[2]))
        if gateway:
            # A keyed gateway's /ready wants a key this helper does not hold: its caller waits for
            # /ready with one (test_e2e_key_limits.py); /health answers from the start.
            keyed = {"--api-key", "--api-key-file"} & set(gateway_flags)
            wait_until(lambda: http_ok(f"{stack.http_url}/{'health' if keyed else 'ready'}"), 300, "the gateway", stack)
    except BaseException:
        stack.stop()
        raise
    return stack


@contextlib.contextmanager
def ttserve_up(tmp: Path, *flags: str) -> Iterator[tuple[subprocess.Popen, list[int]]]:
    """`ttserve up` on free ports (HTTP, control, worker, control metrics, worker metrics), once its
    gateway is ready (/ready: a gateway still waiting for its control plane answers /health too);
    killed on the way out if the test has not stopped it."""
    ports = [free_port() for _ in range(5)]
    log = open(tmp / "up.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "ttserve.cli", "up", "--port", str(ports[0]),
                             "--control-port", str(ports[1]), "--worker-port", str(ports[2]),
                             "--control-metrics-port", str(ports[3]), "--worker-metrics-port", str(ports[4]),
                             *flags], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: http_ok(f"http://127.0.0.1:{ports[0]}/ready"), 300, "ttserve up")
        yield proc, ports
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
