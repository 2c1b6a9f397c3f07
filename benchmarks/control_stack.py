"""Workers and a control plane as real processes, for the token-level benchmarks."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
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
    every worker is ready, and stops everything on exit."""
    ports = [free_port() for _ in worker_args]
    control_port = free_port()
    # Every service gets its own metrics port: the defaults would collide between workers.
    procs = [subprocess.Popen([sys.executable, "-m", "ttserve.worker", "--port", str(port),
                               "--metrics-port", str(free_port()), *args],
                              stderr=subprocess.DEVNULL) for port, args in zip(ports, worker_args)]
    procs.append(subprocess.Popen([sys.executable, "-m", "ttserve.control", "--port", str(control_port),
                                   "--metrics-port", str(free_port()),
                                   *[a for p in ports for a in ("--worker", f"127.0.0.1:{p}")], *control_args],
                                  stderr=subprocess.DEVNULL))
    address = f"127.0.0.1:{control_port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not _ready(address):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit(f"the stack ({control_args}) did not come up; run it by hand to see why")
            time.sleep(0.3)
        client = ControlClient(address)
        try:
            yield client
        finally:
            client.close()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


def _ready(address: str) -> bool:
    try:
        info = ControlClient(address).server_info()
    except Exception:
        return False
    return info.ready and all(w.ready for w in info.workers)
