"""deploy/systemd executed without systemd as PID 1: the units read as systemd reads them, started
in the order of a `systemctl start ttserve.target` transaction as host processes on one host (a
tests/netns.py namespace, so the units' default ports collide with nothing), supervised by their
Restart= settings and stopped by their KillSignal=/TimeoutStopSec=.

What the units say, and what the harness makes of it:
- The transaction: the units enabled into the target (WantedBy=ttserve.target), their Wants= and
  Requires= among deploy/systemd's units (others, network-online.target, count as active),
  ordered by After=/Before= (topological; a cycle raises UnitError, as systemd refuses it); stop
  is the reverse. A template (ttserve-worker@.service) runs as instances named when enabling.
- Specifiers: %d (the credentials directory), %S (/var/lib), %C (/var/cache), %t (/run), %E
  (/etc), %i/%I (instance), %n/%N/%p (names), %% ; all map into the test's folder.
- LoadCredential=ID:PATH copies PATH into %d/ID before the start (as root; a missing file fails
  the start, as systemd does without a "-"); CREDENTIALS_DIRECTORY, STATE_DIRECTORY and
  CACHE_DIRECTORY are set, StateDirectory=/CacheDirectory= created.
- Environment= (quoted assignments, several per line) then EnvironmentFile= (systemd's syntax;
  "-" optional), which wins, over systemd's default PATH; ExecStart= with specifiers, then
  unbraced $VAR words split into words honouring quotes and ${VAR} substituted inside a word.
- Paths: /opt/ttserve/.venv is this repository's .venv; /etc/ttserve and the specifier roots are
  folders of the test (tests/host_process.py: rewritten, not bind-mounted).
- Type=exec: a unit counts as started once its process runs, and the next one starts then.
- Restart=on-failure: an exit with a non-zero status not in RestartPreventExitStatus=, or by a
  signal, restarts after RestartSec=, at most StartLimitBurst= starts in StartLimitIntervalSec=.
- Stop: KillSignal= to the main process (KillMode=mixed), TimeoutStopSec=, then SIGKILL.
- Honoured through setpriv (host_process.NO_PRIVILEGES): NoNewPrivileges=yes and the empty
  CapabilityBoundingSet=/AmbientCapabilities=. Ignored: User=/Group= (no ttserve user here: root
  without capabilities), the other sandboxing (ProtectSystem=, PrivateTmp=, SystemCallFilter=,
  RestrictAddressFamilies= ...: they need systemd to enforce; tests/test_deploy.py checks them
  with systemd-analyze verify and security), Limit*=, UMask=, DeviceAllow=, PartOf= (only stops
  or restarts of the target, which the harness does unit by unit anyway).
"""
from __future__ import annotations

import re
import shlex
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from host_process import HostProcess, PathMap, Stopped, signal_number, start
from netns import Network

INSTALLED_VENV = "/opt/ttserve/.venv"
INSTALLED_BINARY = f"{INSTALLED_VENV}/bin/ttserve"
# systemd's default PATH for system services (systemd.exec(5), "Environment variables").
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"


class UnitError(Exception):
    """A unit that systemd would refuse (a cycle, a missing credential, a bad specifier)."""


# ---- reading units and environment files ------------------------------------------------------

def read_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """section -> [(key, value)] in order; keys repeat (Environment=, EnvironmentFile=)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        assert current is not None and "=" in line, f"{path.name}: {raw!r}"
        key, value = line.split("=", 1)
        current.append((key.strip(), value.strip()))
    return sections


def values(unit: dict, section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def one(unit: dict, section: str, key: str) -> str | None:
    found = values(unit, section, key)
    return found[-1] if found else None


def words(unit: dict, section: str, key: str) -> set[str]:
    return {w for v in values(unit, section, key) for w in v.split()}


def seconds(value: str) -> float:
    """A systemd time span such as 60, 90s, 1min 30s."""
    scale = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "ms": 0.001}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * scale[unit]
    return total


def read_env_file(path: Path) -> dict[str, str]:
    return parse_env_text(path.read_text(), path.name)


def parse_env_text(text: str, name: str = "env file") -> dict[str, str]:
    """An EnvironmentFile= as systemd reads it, for the subset the examples may use: a value that
    starts with a quote loses that pair of quotes, any other keeps its quotes verbatim; no
    backslashes (systemd would drop them), no line continuations."""
    env = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()), f"{name}: {raw!r}"
        assert "\\" not in value, f"{name}: {key}: systemd drops backslashes from values"
        value = value.strip()
        if value[:1] in ("'", '"'):
            assert value[-1] == value[0] and len(value) > 1, f"{name}: {key}: unbalanced quote"
            value = value[1:-1]
        env[key.strip()] = value
    return env


def expand_exec_args(exec_start: str, env: Mapping[str, str]) -> list[str]:
    """ExecStart= arguments after systemd's expansion: an unbraced $VAR word becomes the
    variable's words, split honouring quotes (EXTRACT_UNQUOTE, like shlex); ${VAR} is replaced
    inside its word, unsplit. Specifiers are expanded before (expand_specifiers)."""
    argv = []
    for word in shlex.split(exec_start.lstrip("@-:+!")):
        if re.fullmatch(r"\$[A-Za-z_][A-Za-z0-9_]*", word):
            argv += shlex.split(env.get(word[1:], ""))
        else:
            argv.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m.group(1), ""), word))
    return argv


def expand_specifiers(text: str, specifiers: Mapping[str, str]) -> str:
    def one_specifier(match: re.Match) -> str:
        letter = match.group(1)
        if letter == "%":
            return "%"
        if letter not in specifiers:
            raise UnitError(f"specifier %{letter} in {text!r} is not one the harness knows")
        return specifiers[letter]
    return re.sub(r"%(.)", one_specifier, text)


def environment_assignments(value: str) -> dict[str, str]:
    """One Environment= line: space-separated assignments, each optionally quoted."""
    return dict(word.split("=", 1) for word in shlex.split(value))


# ---- the transaction --------------------------------------------------------------------------

@dataclass
class Unit:
    name: str                    # ttserve-worker@0.service for an instance
    sections: dict
    instance: str = ""

    def words(self, section: str, key: str) -> set[str]:
        return {self.expand(w) for w in words(self.sections, section, key)}

    def expand(self, text: str, extra: Mapping[str, str] = ()) -> str:
        prefix = self.name.rsplit(".", 1)[0]
        names = {"i": self.instance, "I": self.instance, "n": self.name, "N": prefix,
                 "p": prefix.split("@")[0]}
        return expand_specifiers(text, {**names, **dict(extra)})


def load_units(folder: Path, enabled: Sequence[str]) -> dict[str, Unit]:
    """The units of `folder`, with each enabled instance of a template (name@X.service)."""
    units = {}
    for path in sorted(folder.glob("*.service")) + sorted(folder.glob("*.target")):
        if "@." not in path.name:
            units[path.name] = Unit(path.name, read_unit(path))
    for name in enabled:
        match = re.fullmatch(r"(.+@)(.+)(\.service)", name)
        if match:
            template = folder / f"{match.group(1)}{match.group(3)}"
            units[name] = Unit(name, read_unit(template), instance=match.group(2))
    return units


def transaction(target: str, units: Mapping[str, Unit], enabled: Sequence[str]) -> list[str]:
    """The units `systemctl start target` starts, in start order (After=/Before= topological,
    ties in name order). Wants=/Requires= outside `units` are taken as active already."""
    pulled = {target} | {name for name in enabled if target in units[name].words("Install", "WantedBy")}
    todo = list(pulled)
    while todo:
        unit = units[todo.pop()]
        for name in unit.words("Unit", "Wants") | unit.words("Unit", "Requires"):
            if name in units and name not in pulled and not _masked(name, enabled):
                pulled.add(name)
                todo.append(name)
    before = {name: set() for name in pulled}  # name -> units that must start before it
    for name in pulled:
        for other in units[name].words("Unit", "After") & pulled:
            before[name].add(other)
        for other in units[name].words("Unit", "Before") & pulled:
            before[other].add(name)
        # A target (DefaultDependencies=yes) is ordered after what it wants, WantedBy= included:
        # systemd.target(5), "Implicit Dependencies" / "Default Dependencies".
        if name.endswith(".target"):
            for other in pulled:
                wants = units[other].words("Install", "WantedBy") | units[other].words("Install", "RequiredBy")
                if name in wants and other != name:
                    before[name].add(other)
            before[name] |= (units[name].words("Unit", "Wants") | units[name].words("Unit", "Requires")) & pulled
    order: list[str] = []
    while before:
        ready = sorted(name for name, deps in before.items() if not deps)
        if not ready:
            raise UnitError(f"ordering cycle among {sorted(before)}")
        for name in ready:
            order.append(name)
            del before[name]
        for deps in before.values():
            deps.difference_update(ready)
    return order


def _masked(name: str, enabled: Sequence[str]) -> bool:
    """The single-worker unit is masked on a host that runs template instances (deploy/README.md)."""
    return name == "ttserve-worker.service" and any(n.startswith("ttserve-worker@") for n in enabled)


# ---- running ----------------------------------------------------------------------------------

@dataclass
class Run:
    """A unit's life: each start's process; `failed` once systemd would give up on it."""
    unit: Unit
    processes: list[HostProcess] = field(default_factory=list)
    exits: list[int] = field(default_factory=list)
    stopping: bool = False
    failed: str = ""

    @property
    def current(self) -> HostProcess:
        return self.processes[-1]


class Host:
    """One machine with deploy/systemd's units installed: /etc/ttserve (env files, tls) under
    `root`, this repository's venv at /opt/ttserve/.venv."""

    def __init__(self, units_folder: Path, root: Path, venv: Path, net: Network, host: str,
                 enabled: Sequence[str]) -> None:
        self.units = load_units(units_folder, enabled)
        self.enabled = list(enabled)
        self.root, self.net, self.host = root, net, host
        self.etc = root / "etc" / "ttserve"
        self.etc.mkdir(parents=True, exist_ok=True)
        self.specifier_roots = {"S": root / "var" / "lib", "C": root / "var" / "cache", "t": root / "run",
                                "E": root / "etc"}
        self.paths = PathMap({INSTALLED_VENV: venv, "/etc/ttserve": self.etc})
        self.runs: dict[str, Run] = {}
        self._lock = threading.Lock()
        self._stop_supervising = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="systemd-supervisor", daemon=True)
        self._supervisor.start()

    # -- one unit --

    def _specifiers(self, unit: Unit) -> dict[str, str]:
        credentials = self.root / "run" / "credentials" / unit.name
        return {"d": str(credentials), **{k: str(v) for k, v in self.specifier_roots.items()}}

    def command(self, name: str) -> tuple[list[str], dict[str, str]]:
        """The unit's ExecStart= argv and environment as systemd would exec them (mapped)."""
        unit = self.units[name]
        spec = self._specifiers(unit)
        env = {"PATH": SYSTEMD_PATH, "LANG": "C.UTF-8", "CREDENTIALS_DIRECTORY": spec["d"]}
        for key, folder in (("StateDirectory", "S"), ("CacheDirectory", "C")):
            for sub in unit.words("Service", key):
                env[f"{key.upper().replace('DIRECTORY', '_DIRECTORY')}"] = f"{spec[folder]}/{sub}"
        for value in values(unit.sections, "Service", "Environment"):
            env.update(environment_assignments(unit.expand(value, spec)))
        for value in values(unit.sections, "Service", "EnvironmentFile"):
            path = self.paths(unit.expand(value.lstrip("-"), spec))
            if Path(path).is_file():
                env.update(read_env_file(Path(path)))
            elif not value.startswith("-"):
                raise UnitError(f"{name}: EnvironmentFile={value}: no such file")
        argv = expand_exec_args(unit.expand(one(unit.sections, "Service", "ExecStart"), spec), env)
        return self.paths.argv(argv), self.paths.env(env)

    def _prepare(self, name: str) -> None:
        unit = self.units[name]
        spec = self._specifiers(unit)
        credentials = Path(spec["d"])
        shutil.rmtree(credentials, ignore_errors=True)
        credentials.mkdir(parents=True)
        for value in values(unit.sections, "Service", "LoadCredential"):
            ident, _, source = value.partition(":")
            host_source = Path(self.paths(unit.expand(source, spec)))
            if not host_source.is_file():
                raise UnitError(f"{name}: LoadCredential={value}: {host_source} does not exist; "
                                "systemd fails the start")
            shutil.copyfile(host_source, credentials / ident)
            (credentials / ident).chmod(0o400)
        for key, folder in (("StateDirectory", "S"), ("CacheDirectory", "C")):
            for sub in unit.words("Service", key):
                Path(spec[folder], sub).mkdir(parents=True, exist_ok=True)

    def start_unit(self, name: str) -> HostProcess:
        self._prepare(name)
        argv, env = self.command(name)
        directory = self.paths(one(self.units[name].sections, "Service", "WorkingDirectory") or "/")
        logs = self.root / "logs"
        logs.mkdir(exist_ok=True)
        process = start(self.net, self.host, name, argv, env, cwd=Path(directory), log_dir=logs)
        with self._lock:
            run = self.runs.setdefault(name, Run(self.units[name]))
            run.processes.append(process)
        return process

    # -- the target --

    def start(self, target: str = "ttserve.target") -> list[str]:
        """`systemctl start target`: each service of the transaction once the ones ordered before
        it have started (Type=exec: once their process runs); the start order."""
        order = transaction(target, self.units, self.enabled)
        for name in order:
            if name.endswith(".service"):
                self.start_unit(name)
        return order

    def stop(self, target: str = "ttserve.target") -> dict[str, Stopped]:
        """`systemctl stop target`: the reverse of the start order, each unit stopped before the
        units it is ordered after (KillSignal=, TimeoutStopSec=, then SIGKILL)."""
        stopped = {}
        for name in reversed(transaction(target, self.units, self.enabled)):
            stopped.update(self.stop_unit(name) if name in self.runs else {})
        return stopped

    def stop_unit(self, name: str) -> dict[str, Stopped]:
        unit = self.units[name]
        with self._lock:
            run = self.runs[name]
            run.stopping = True
        sig = signal_number(one(unit.sections, "Service", "KillSignal") or "SIGTERM")
        timeout = seconds(one(unit.sections, "Service", "TimeoutStopSec") or "90")
        return {name: run.current.stop(sig, timeout)}

    def close(self) -> None:
        self._stop_supervising.set()
        self._supervisor.join(timeout=5)
        for name in list(self.runs):
            if self.runs[name].current.alive():
                self.stop_unit(name)

    def logs(self) -> str:
        return "\n".join(f"--- {name} (start {len(run.processes)}) ---\n{run.current.output()}"
                         for name, run in self.runs.items())

    # -- Restart= --

    def _supervise(self) -> None:
        pending: dict[str, float] = {}  # unit -> when to restart it
        while not self._stop_supervising.wait(0.2):
            now = time.monotonic()
            with self._lock:
                runs = list(self.runs.items())
            for name, run in runs:
                if run.stopping or run.failed or name in pending or run.current.alive():
                    continue
                status = run.current.proc.returncode
                run.exits.append(status)
                decision = restart_decision(run.unit, status, [p.started for p in run.processes], now)
                if decision is None:
                    run.failed = f"exited with status {status}: no restart (Restart=, RestartPreventExitStatus=)"
                elif decision == "limit":
                    run.failed = "start limit hit (StartLimitBurst= in StartLimitIntervalSec=)"
                else:
                    pending[name] = now + decision
            for name, when in list(pending.items()):
                if time.monotonic() >= when and not self.runs[name].stopping:
                    del pending[name]
                    self.start_unit(name)


def restart_decision(unit: Unit, status: int, starts: Sequence[float], now: float) -> float | str | None:
    """What systemd does when the unit's main process exits (not by a stop): None (stays dead or
    failed), "limit" (the start limit is hit), or the seconds until it restarts. A negative
    status is death by that signal, a failure for Restart=on-failure."""
    restart = one(unit.sections, "Service", "Restart") or "no"
    prevented = {int(s) for s in unit.words("Service", "RestartPreventExitStatus") if s.isdigit()}
    clean = status == 0
    restarts = {"no": False, "always": True, "on-success": clean, "on-failure": not clean,
                "on-abnormal": status < 0, "on-abort": status < 0}[restart]
    if not restarts or status in prevented:
        return None
    interval = seconds(one(unit.sections, "Unit", "StartLimitIntervalSec") or "10")
    burst = int(one(unit.sections, "Unit", "StartLimitBurst") or "5")
    if len([t for t in starts if now - t < interval]) >= burst:
        return "limit"
    return seconds(one(unit.sections, "Service", "RestartSec") or "0.1")
