"""Several hosts, really: the control plane and two workers each in its own network namespace on
one private bridge (tests/netns.py), reaching each other by host name over mutual TLS with
certificates that name those hosts, the workers listening on their own addresses (so the exposure
rules apply) and admitting only the control plane's identity. A worker partitioned mid-stream
(its link down) loses nothing: its requests finish on the other worker with the tokens of an
uninterrupted run; healed, it is taken back. Traffic never leaves the machine."""
from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path

import pytest

import host_process
from certs import CertificateAuthority
from netns import Network, require_netns
from stack import sample, wait_until

pytestmark = pytest.mark.e2e

WORKER_FLAGS = ("--dtype", "float32", "--num-threads", "1")  # fp32: the greedy oracle holds (test_e2e_migration.py)
LOAD = Path(__file__).parent / "steady_load.py"
# Each request runs over many steps (the partitioned worker holds some mid-stream), and the
# load's phases pass quickly.
MAX_TOKENS = 16


class Hosts:
    """The services of one test on a Network, with their logs."""

    def __init__(self, net: Network, tmp: Path) -> None:
        self.net, self.tmp = net, tmp
        ca = CertificateAuthority(tmp / "tls", "ca")
        self.ca = ca.cert
        self.certs = {host: ca.issue(host, (net.address(host), host, "127.0.0.1")) for host in net.hosts}

    def start(self, host: str, module: str, *args: str) -> None:
        host_process.start(self.net, host, host, [sys.executable, "-m", module, *args,
                                                  *self.certs[host].flags(self.ca)],
                           os.environ, cwd=self.tmp, log_dir=self.tmp, privileged=True)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.tmp.glob("*.log")))

    def control_metrics(self) -> str:
        with self.net.inside("control"):
            with urllib.request.urlopen("http://127.0.0.1:9401/metrics", timeout=5) as r:
                return r.read().decode()


def report(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def test_a_partitioned_worker_loses_nothing_and_is_taken_back_once_healed(tmp_path, smollm2):
    require_netns()
    with Network(["control", "w0", "w1"]) as net:
        hosts = Hosts(net, tmp_path)
        # The exposure rule on a real address: no mutual TLS, no start (exit 2, before any model).
        bare = net.run("w0", [sys.executable, "-m", "ttserve.worker", "--host", net.address("w0"),
                              "--model", str(smollm2), "--metrics-port", "0"], capture_output=True, text=True,
                       timeout=120)
        assert bare.returncode == 2 and "refusing to serve" in bare.stderr + bare.stdout, bare.stderr[-2000:]
        for w in ("w0", "w1"):
            hosts.start(w, "ttserve.worker", "--host", net.address(w), "--port", "50061", "--metrics-port", "9402",
                        "--model", str(smollm2), *WORKER_FLAGS, "--control-identity", "control")
        # By host name: /etc/hosts of the control plane's namespace names w0 and w1, and their
        # certificates name them. A 3 s --stall-timeout finds the partitioned worker quickly.
        hosts.start("control", "ttserve.control", "--port", "50051", "--metrics-port", "9401",
                    "--worker", "w0=w0:50061", "--worker", "w1=w1:50061", "--stall-timeout", "3")

        def ready(*workers: str) -> bool:
            text = hosts.control_metrics()
            return all(sample(text, "ttserve_worker_ready", worker=w) == 1 for w in workers)

        wait_until(lambda: ready("w0", "w1"), 240, "both workers to serve")
        # The metrics port takes no key: it stays on loopback whatever --host is (no --metrics-host).
        probe = net.run("control", [sys.executable, "-c", "import socket, sys; s = socket.socket(); "
                                    "s.settimeout(3); sys.exit(s.connect_ex(('w0', 9402)))"], timeout=30)
        assert probe.returncode != 0, "w0's metrics port answered on its network address"
        stop, status = tmp_path / "stop", tmp_path / "load.json"
        control = hosts.certs["control"]
        load = host_process.start(net, "control", "load", [
            sys.executable, str(LOAD), "--control", "127.0.0.1:50051", "--stop-file", str(stop),
            "--max-tokens", str(MAX_TOKENS), "--report", str(status),
            "--tls", str(control.cert), str(control.key), str(hosts.ca)],
            os.environ, cwd=tmp_path, log_dir=tmp_path, privileged=True).proc
        try:
            wait_until(lambda: len(report(status).get("placements", [])) == 2 and report(status)["finished"] >= 4,
                       180, "the load to run on both workers")
            net.partition("w0")  # mid-stream: w0 holds requests and a step in flight
            wait_until(lambda: (sample(hosts.control_metrics(), "ttserve_worker_stalls_total", worker="w0") or 0) >= 1,
                       60, "the control plane to find w0 gone")
            done = report(status)["finished"]
            wait_until(lambda: report(status)["finished"] >= done + 4, 120, "the load to go on, on w1")
            assert load.poll() is None, hosts.logs()
            net.heal("w0")
            # Its old step stream dies by keepalive (or the control plane's reset arrives): w0
            # takes the new one and serves again.
            wait_until(lambda: ready("w0"), 120, "w0 to be taken back after the heal")
            done = report(status)["finished"]
            wait_until(lambda: report(status)["finished"] >= done + 4, 120, "the load to go on, on both")
        finally:
            stop.touch()
        load.wait(timeout=300)
        outcome = report(status)
        assert outcome.get("stopped"), hosts.logs() + (tmp_path / "load.log").read_text()
        assert outcome["mismatches"] == [], outcome["mismatches"]
        assert outcome["requests"] >= 12
        metrics = hosts.control_metrics()
        assert sample(metrics, "ttserve_request_migrations_total", outcome="requeued") >= 1
        assert sample(metrics, "ttserve_request_migrations_total", outcome="failed_limit") == 0
        assert sample(metrics, "ttserve_request_migrations_total", outcome="failed_timeout") == 0
