"""A deployed service as a host process, the part the compose and systemd harnesses share: its
paths mapped from the deployment's view (container or installed paths) onto this machine's, run
inside one host of a tests/netns.py Network without privileges, logged to a file, and stopped the
way an orchestrator stops it (one signal, a grace period, then SIGKILL).

Paths are mapped by rewriting strings (argv, environment values, healthcheck commands, mounted
configuration), not by bind mounts in a private mount namespace: a mount namespace isolates
mounts, not directories, so every mount point (/models, /run/secrets, /opt/ttserve/.venv ...)
would have to be created in this machine's real root file system, where /opt/ttserve may be a
real install and other test runs look at the same paths. Rewriting leaves the machine as it was;
its limit is that a program computing a container path itself (none of ttserve's do) escapes it.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from netns import Network


class PathMap:
    """Deployment path prefix -> path on this machine. A prefix matches only as a whole path
    component sequence at the start of a path (after a quote, '=', ':', ',', space or the start
    of the string), so /models maps /models/x and '/models' but not /srv/models or /modelsx."""

    def __init__(self, mapping: Mapping[str, Path | str] = ()) -> None:
        self._map: dict[str, str] = {}
        for prefix, target in dict(mapping).items():
            self.add(prefix, target)

    def add(self, prefix: str, target: Path | str) -> None:
        assert prefix.startswith("/") and prefix != "/", prefix
        self._map[prefix.rstrip("/")] = str(target).rstrip("/") or "/"

    def prefixes(self) -> list[str]:
        return list(self._map)

    def __call__(self, text: str) -> str:
        if not self._map:
            return text
        # Longest prefix first: /var/cache/ttserve/vllm before /var/cache/ttserve.
        alternatives = "|".join(re.escape(p) for p in sorted(self._map, key=len, reverse=True))
        pattern = rf"(?<![^\s'\"=:,(\[])({alternatives})(?=/|$|[\s'\":,)\]])"
        return re.sub(pattern, lambda m: self._map[m.group(1)], text)

    def argv(self, argv: Iterable[str]) -> list[str]:
        return [self(arg) for arg in argv]

    def env(self, env: Mapping[str, str]) -> dict[str, str]:
        return {key: self(value) for key, value in env.items()}

    def host_path(self, path: str) -> Path:
        """A deployment path that must be mapped (a secret, a mounted file)."""
        mapped = self(path)
        assert mapped != path, f"{path}: no mapping covers it ({self.prefixes()})"
        return Path(mapped)


# What `cap_drop: [ALL]` + `no-new-privileges` (compose) and `CapabilityBoundingSet=` (empty) +
# `NoNewPrivileges=yes` (systemd) leave a process: no capability in any set, for it and its
# children. The harness runs as root (no ttserve user here); without capabilities root can still
# read the root-owned 0600 keys it wrote, as the service user can read its own in a deployment.
NO_PRIVILEGES = ["setpriv", "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all"]


@dataclass
class Stopped:
    returncode: int
    seconds: float
    killed: bool  # the grace period passed and SIGKILL ended it


@dataclass
class HostProcess:
    """One running service. Its Popen pid is the service itself (`ip netns exec` and setpriv
    both exec in place), so a signal sent to it reaches the service, as tini or systemd's
    KillMode=mixed deliver it."""
    name: str
    host: str
    proc: subprocess.Popen
    log_path: Path
    started: float

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 30.0) -> Stopped:
        """`sig`, then up to `grace_s` for the process to exit, then SIGKILL."""
        begin = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                return Stopped(self.proc.returncode, time.monotonic() - begin, True)
        return Stopped(self.proc.returncode, time.monotonic() - begin, False)


def start(net: Network, host: str, name: str, argv: Sequence[str], env: Mapping[str, str], *,
          cwd: Path, log_dir: Path, privileged: bool = False) -> HostProcess:
    """`argv` (already mapped) in `host`'s namespace with exactly `env` (a container or unit
    starts with its own environment, not the test's), without capabilities unless `privileged`.
    `argv[0]` is looked up in env's PATH, as the image's exec-form ENTRYPOINT is."""
    log_path = log_dir / f"{name}.log"
    log = open(log_path, "ab")
    try:
        command = list(argv) if privileged else [*NO_PRIVILEGES, *argv]
        # Its own session (process group): SIGKILL after the grace period reaches the helpers it
        # forked too, as Docker's kill of a container and KillMode=mixed's of a cgroup do.
        proc = net.popen(host, command, env=dict(env), cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        log.close()  # the child holds its own descriptor
    return HostProcess(name, host, proc, log_path, time.monotonic())


def signal_number(name: str | int) -> int:
    """SIGTERM, TERM or 15 -> 15 (compose's stop_signal, systemd's KillSignal=)."""
    if isinstance(name, int) or str(name).isdigit():
        return int(name)
    name = str(name).upper()
    return int(getattr(signal, name if name.startswith("SIG") else f"SIG{name}"))


def default_path() -> str:
    """The PATH a container starts with when its image sets none (Docker's default), which is
    also what a Dockerfile's $PATH expands to in ENV PATH=...:$PATH for the Debian-based images."""
    return "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def program(argv0: str, env: Mapping[str, str]) -> str | None:
    """Where `argv0` resolves through env's PATH (None: nowhere)."""
    if "/" in argv0:
        return argv0 if os.access(argv0, os.X_OK) else None
    for folder in env.get("PATH", default_path()).split(":"):
        candidate = Path(folder) / argv0
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None
