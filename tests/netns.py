"""Several hosts on one machine, for tests: one Linux network namespace per host, each joined by a
veth pair to one bridge that lives in a private hub namespace.

    with Network(["control", "w0", "w1"]) as net:
        net.address("w0")                           # "10.a.b.3"
        proc = net.popen("w0", ["ttserve", ...])    # runs inside w0's namespace
        net.partition("w0"); net.heal("w0")         # pull w0's cable at the switch, plug it back
        with net.inside("control"):                 # this thread's sockets live in control's namespace
            urllib.request.urlopen("http://127.0.0.1:9401/health")

Invariants:
- Nothing is created in the root namespace: each veth pair is created with one end directly in
  its host's namespace (named eth0 there) and the other in the hub's (h0, h1, ...), so interface
  names cannot collide with other runs or with the machine's own, and the 15-character limit is
  never approached. The test process reaches a host through `inside` (setns on the calling
  thread), not through a route of its own.
- Traffic never leaves the machine: no namespace has a default route, there is no NAT, and the
  bridge has no port outside the hub. Each host has loopback up and one address on a /24 that is
  random per run (10.R.R.0/24); the namespaces' names carry the pid and a random tag, so
  concurrent runs never share one.
- Every host resolves every other host (and itself) by name: /etc/netns/<ns>/hosts, which
  `ip netns exec` bind-mounts over /etc/hosts, with an empty resolv.conf beside it so that an
  unknown name fails at once instead of waiting on a nameserver that cannot be reached.
  `inside` does not see these files (no mount namespace): there, use addresses.
- On exit, every process `popen` started that still runs is killed (by its pid) and reaped, and
  so is any process still inside one of the namespaces (necessarily one of theirs); then the
  namespaces (and with them the bridge and the veths) and the /etc/netns folders are removed,
  also when the body raised. /etc/netns itself stays: other runs may be using it.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import random
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from stack import REQUIRE_OPS_TOOLS, require_tool

NETNS_RUN_DIR = Path("/run/netns")
NETNS_ETC_DIR = Path("/etc/netns")
CLONE_NEWNET = 0x40000000  # <sched.h>; os.setns (and this constant) only arrived in Python 3.12
HOST_IFACE = "eth0"
_NETWORKS = itertools.count()
BRIDGE = "br0"


def require_netns() -> None:
    """Skips (or, with TTSERVE_REQUIRE_OPS_TOOLS=1, fails) unless this process can make network
    namespaces: root, iproute2's `ip`, and a kernel/container that allows `ip netns add`."""
    require_tool("ip")
    reason = None
    if os.geteuid() != 0:
        reason = "network namespaces need root"
    else:
        probe = f"ttprobe{os.getpid()}"
        done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if done.returncode != 0:
            reason = f"`ip netns add` fails here: {done.stderr.strip()}"
        else:
            subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    if reason is None:
        return
    if REQUIRE_OPS_TOOLS:
        pytest.fail(f"{reason}; TTSERVE_REQUIRE_OPS_TOOLS=1 requires it")
    pytest.skip(reason)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def namespace_inode(name: str) -> int:
    """The identity of a named namespace: the inode that /proc/PID/ns/net links name as net:[N]."""
    return os.stat(NETNS_RUN_DIR / name).st_ino


class Network:
    """Hosts (namespaces) on one private bridge; see the module docstring for the invariants."""

    def __init__(self, hosts: Sequence[str], *, names: bool = True) -> None:
        """`hosts`: the host names, distinct, each usable as a DNS label. `names`: write
        /etc/hosts-style files so that hosts reach each other by name (through popen)."""
        assert len(set(hosts)) == len(hosts) and hosts, hosts
        assert len(hosts) <= 250, "one /24"
        self.hosts = list(hosts)
        self._names = names
        # The pid keeps concurrent runs apart, the count Networks of one run, the random tag a pid
        # reused by a later run whose predecessor left something behind (a killed -9 run might).
        self.tag = f"tt{os.getpid()}{next(_NETWORKS)}{random.randrange(16 ** 2):02x}"
        self.hub = f"{self.tag}-hub"
        subnet = (random.randrange(16, 250), random.randrange(0, 256))
        self.prefix = f"10.{subnet[0]}.{subnet[1]}"
        self._address = {host: f"{self.prefix}.{i + 2}" for i, host in enumerate(self.hosts)}
        self._hub_port = {host: f"h{i}" for i, host in enumerate(self.hosts)}
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self.inodes: dict[str, int] = {}

    # ---- set-up and tear-down -----------------------------------------------------------------

    def namespace(self, host: str) -> str:
        """The `ip netns` name of a host's namespace."""
        assert host in self._address, f"no host {host!r} in {self.hosts}"
        return f"{self.tag}-{host}"

    def __enter__(self) -> "Network":
        try:
            self._add_namespace(self.hub)
            _ip("-n", self.hub, "link", "add", BRIDGE, "type", "bridge")
            _ip("-n", self.hub, "link", "set", BRIDGE, "up")
            for host in self.hosts:
                ns = self.namespace(host)
                self._add_namespace(ns)
                _ip("link", "add", HOST_IFACE, "netns", ns, "type", "veth",
                    "peer", "name", self._hub_port[host], "netns", self.hub)
                _ip("-n", self.hub, "link", "set", self._hub_port[host], "master", BRIDGE, "up")
                _ip("-n", ns, "addr", "add", f"{self._address[host]}/24", "dev", HOST_IFACE)
                _ip("-n", ns, "link", "set", HOST_IFACE, "up")
                if self._names:
                    self._write_names(ns)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_namespace(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._created.append(ns)
        self.inodes[ns] = namespace_inode(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _write_names(self, ns: str) -> None:
        folder = NETNS_ETC_DIR / ns
        folder.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        lines += [f"{address}\t{host}" for host, address in self._address.items()]
        (folder / "hosts").write_text("\n".join(lines) + "\n")
        # No nameserver: glibc then asks 127.0.0.1:53 inside the namespace, refused at once.
        (folder / "resolv.conf").write_text("# ttserve test network: names come from hosts only\n")

    def close(self) -> None:
        """Kills what popen started and still runs, then removes namespaces and /etc/netns
        folders. Idempotent. A namespace is only destroyed once no process is left in it, which
        is why the processes go first."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self._procs.clear()
        # What those processes started and left behind (a helper a killed service forked): only
        # our processes' descendants can be inside these private namespaces.
        for ns in self._created:
            for pid in processes_in(self.inodes[ns]):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for ns in reversed(self._created):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
            shutil.rmtree(NETNS_ETC_DIR / ns, ignore_errors=True)
        self._created.clear()

    # ---- using it -----------------------------------------------------------------------------

    def address(self, host: str) -> str:
        """The host's IPv4 address on the network."""
        self.namespace(host)
        return self._address[host]

    def popen(self, host: str, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """`argv` run inside the host's namespace (and, with names, its /etc/hosts). `ip netns
        exec` execs argv in place, so the returned Popen's pid is argv's own process: signals
        sent to it reach the program itself. Killed on exit if still running."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *argv], **popen_kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: str, argv: Sequence[str], **run_kwargs) -> subprocess.CompletedProcess:
        """subprocess.run of `argv` inside the host's namespace."""
        return subprocess.run(["ip", "netns", "exec", self.namespace(host), *argv], **run_kwargs)

    def partition(self, host: str) -> None:
        """Cuts the host off: its port on the bridge goes down, as if its cable were pulled at the
        switch. The host's own interface and address stay, so its packets are sent and silently
        lost (no ENETUNREACH), and established connections see silence, not resets. Loopback
        inside the host keeps working."""
        _ip("-n", self.hub, "link", "set", self._hub_port[host], "down")

    def heal(self, host: str) -> None:
        """Undoes partition(host)."""
        _ip("-n", self.hub, "link", "set", self._hub_port[host], "up")

    @contextlib.contextmanager
    def inside(self, host: str) -> Iterator[None]:
        """The calling thread in the host's network namespace for the body (setns(2) on this
        thread only; the rest of the process stays where it is). Sockets opened in the body
        belong to the host's namespace for their whole life, also after the body."""
        libc = ctypes.CDLL(None, use_errno=True)
        back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(NETNS_RUN_DIR / self.namespace(host), os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.namespace(host)}")
            try:
                yield
            finally:
                if libc.setns(back, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back to the original namespace")
        finally:
            os.close(target)
            os.close(back)


def processes_in(inode: int) -> list[int]:
    """Pids of the processes whose network namespace is `inode` (a leaked namespace lives on
    through them after its name is gone)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(entry / "ns" / "net") == f"net:[{inode}]":
                    pids.append(int(entry.name))
    return pids
