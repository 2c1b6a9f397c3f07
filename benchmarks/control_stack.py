"""Workers and a control plane as real processes, for the token-level benchmarks."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from ttserve.control_client import ControlClient


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def control_stack(worker_args: list[list[str]], control_args: list[str],
                  timeout_s: float = 300) -> Iterator[ControlClient]:
    """One worker per entry of `worker_args` under one control plane; yields a client once
    every worker is ready, and stops everything on exit. A port taken between free_port() and
    a service's bind (other processes on the host pick ports too) starts the stack again on new
    ports, once; any other early exit ends the run with the service's last words."""
    for attempt in range(2):
        with tempfile.TemporaryDirectory() as logs:
            services, address = _start(worker_args, control_args, Path(logs))
            try:
                deadline = time.monotonic() + timeout_s
                exited = None
                while not _ready(address):
                    exited = next((log for proc, log in services if proc.poll() is not None), None)
                    if exited is not None or time.monotonic() > deadline:
                        break
                    time.sleep(0.3)
                else:
                    client = ControlClient(address)
                    try:
                        yield client
                    finally:
                        client.close()
                    return
                said = exited.read_text()[-2000:] if exited is not None else ""
                if "cannot listen on" in said and attempt == 0:
                    continue
                raise SystemExit(f"the stack ({control_args}) did not come up"
                                 + (f"; a service exited:\n{said}" if said else f" within {timeout_s:g} s"))
            finally:
                for proc, _ in services:
                    proc.terminate()
                    proc.wait(timeout=30)


def _start(worker_args: list[list[str]], control_args: list[str],
           logs: Path) -> tuple[list[tuple[subprocess.Popen, Path]], str]:
    """The services on fresh ports, each with the file its stderr goes to (in `logs`), and the
    control plane's address."""
    ports = [free_port() for _ in worker_args]
    control_port = free_port()
    # Every service gets its own metrics port: the defaults would collide between workers.
    argvs = [[sys.executable, "-m", "ttserve.worker", "--port", str(port), "--metrics-port", str(free_port()), *args]
             for port, args in zip(ports, worker_args)]
    argvs.append([sys.executable, "-m", "ttserve.control", "--port", str(control_port),
                  "--metrics-port", str(free_port()),
                  *[a for p in ports for a in ("--worker", f"127.0.0.1:{p}")], *control_args])
    services = []
    for i, argv in enumerate(argvs):
        log = logs / f"service-{i}.log"
        with log.open("w") as err:
            services.append((subprocess.Popen(argv, stderr=err), log))
    return services, f"127.0.0.1:{control_port}"


def _ready(address: str) -> bool:
    try:
        info = ControlClient(address).server_info()
    except Exception:
        return False
    return info.ready and all(w.ready for w in info.workers)
