"""tests/netns.py: hosts reach each other over TCP by name and address, a partition cuts a host
off and heal brings it back, and nothing is left behind afterwards."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from netns import NETNS_ETC_DIR, NETNS_RUN_DIR, Network, processes_in, require_netns

# A one-line TCP echo server on port 7000 of every address of its host.
ECHO_SERVER = """
import socket
s = socket.create_server(("0.0.0.0", 7000))
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(c.recv(100))
    c.close()
"""

# Connects to argv[1]:7000 with a timeout, says "ok <reply>" or the error's name.
CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2])) as c:
        c.sendall(b"ping")
        print("ok", c.recv(100).decode())
except OSError as e:
    print(type(e).__name__)
"""


@pytest.fixture(scope="module", autouse=True)
def _netns_available() -> None:
    require_netns()


def reach(net: Network, source: str, target: str, timeout: float = 3) -> str:
    done = net.run(source, [sys.executable, "-c", CLIENT, target, str(timeout)],
                   capture_output=True, text=True, timeout=timeout + 20)
    return done.stdout.strip() or done.stderr


def test_hosts_reach_each_other_partition_and_heal():
    with Network(["a", "b"]) as net:
        server = net.popen("a", [sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "listening"
        a, b = net.address("a"), net.address("b")
        assert a != b and a.rsplit(".", 1)[0] == b.rsplit(".", 1)[0]

        # By address and by name (the /etc/netns hosts file), and inside a host over loopback.
        assert reach(net, "b", a) == "ok ping"
        assert reach(net, "b", "a") == "ok ping"
        assert reach(net, "a", "127.0.0.1") == "ok ping"
        # No way out: loopback and the private /24 are the only routes.
        routes = net.run("b", ["ip", "-4", "route"], capture_output=True, text=True, check=True).stdout
        assert "default" not in routes and routes.strip().startswith(f"{net.prefix}.0/24"), routes
        links = net.run("b", ["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
        assert "lo:" in links and "LOOPBACK,UP" in links, links

        net.partition("a")
        started = time.monotonic()
        assert reach(net, "b", a, timeout=2) != "ok ping"
        assert time.monotonic() - started < 10
        assert reach(net, "a", "127.0.0.1") == "ok ping", "a partitioned host still reaches itself"
        net.heal("a")
        assert reach(net, "b", a) == "ok ping"

        # The test process itself, from inside a host's namespace; outside, the address is unknown.
        with net.inside("b"):
            with socket.create_connection((a, 7000), timeout=3) as c:
                c.sendall(b"from the test")
                assert c.recv(100) == b"from the test"
        assert net.address("b") not in subprocess.run(["ip", "-4", "addr"], capture_output=True,
                                                      text=True).stdout

        namespaces = [net.hub, net.namespace("a"), net.namespace("b")]
        inodes = dict(net.inodes)
        assert all((NETNS_ETC_DIR / net.namespace(h) / "hosts").is_file() for h in ("a", "b"))
        assert server.poll() is None
    # Removed: the server (by its pid), the namespaces by name and in fact (no process left in
    # them, so the kernel destroys them, the bridge and the veths), the /etc/netns folders.
    assert server.returncode is not None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for ns in namespaces:
        assert ns not in listed and not (NETNS_RUN_DIR / ns).exists()
        assert not (NETNS_ETC_DIR / ns).exists()
        assert not processes_in(inodes[ns]), ns
    assert net.tag not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def test_cleanup_after_a_failing_body():
    with pytest.raises(RuntimeError):
        with Network(["x"]) as net:
            proc = net.popen("x", ["sleep", "60"])
            raise RuntimeError("the test failed")
    assert proc.returncode is not None
    assert not (NETNS_RUN_DIR / net.namespace("x")).exists()
    assert not (NETNS_ETC_DIR / net.namespace("x")).exists()
    assert not any(processes_in(inode) for inode in net.inodes.values())


def test_concurrent_networks_do_not_collide():
    with Network(["h"]) as one, Network(["h"]) as two:
        assert one.namespace("h") != two.namespace("h")
        assert str(os.getpid()) in one.tag
