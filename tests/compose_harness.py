"""deploy/docker-compose.yml executed without a container runtime: each service a host process in
its own network namespace (tests/netns.py) named as the service, started in the order its
`depends_on` conditions allow, probed by its `healthcheck` as written, stopped as `docker compose
down` stops it.

What the file says, and what the harness makes of it:
- `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?message}`, `${VAR?message}`, `$VAR`,
  `$$`: interpolated from the --env-file only (the shell's variables are left out, so that a
  developer's TTSERVE_MODEL cannot change the test); a missing required one raises ComposeError.
- `build` (context, dockerfile): the Dockerfile's final stage gives the image's ENTRYPOINT, CMD,
  ENV (in order, $VAR expanded, $PATH from Docker's default), WORKDIR, VOLUME, HEALTHCHECK and
  STOPSIGNAL. The image's virtual environment (ENV VIRTUAL_ENV) is this repository's .venv, so its
  `ttserve` runs in place of the image's; nothing is built. `build.args` are ignored with it.
- `image` without `build`: a stand-in for that image (`STAND_INS`: the image's ENTRYPOINT and
  WORKDIR, as published) whose program is this machine's (Debian's `prometheus` for
  prom/prometheus); an image without one is skipped with the reason in `Project.skipped`.
- `command` replaces CMD; `env_file` and `environment` are added to the image's ENV, in that order.
- `secrets`: /run/secrets/<target> is a per-service folder holding copies of just that service's
  secret files. `volumes`: a named volume is a folder per volume (shared by the services naming
  it), a host path is that path, and a folder of this repository mounted read-only (./prometheus)
  is a copy whose text files get the same path mapping (its config names /run/secrets/...).
  Image folders (WORKDIR, the absolute paths of ENV, VOLUME) are per-service folders. See
  tests/host_process.py for why paths are rewritten rather than bind-mounted.
- `ports`: a published port is reached from the test through `Project.inside(service)` at
  127.0.0.1:<container port>, which is where the published port leads (no NAT: the test network
  never routes off the machine). `expose` needs nothing: every port is open between services.
- `healthcheck` (falling back field by field to the image's HEALTHCHECK, then Docker's defaults):
  test (CMD, CMD-SHELL or NONE) run inside the service's namespace, with its environment, mapped
  paths and working directory; the first probe `interval` (or `start_interval` during the start
  period) after the start, then every `interval`; `timeout` per probe; healthy on a success;
  unhealthy after `retries` consecutive failures, failures in `start_period` before the first
  success not counted.
- `depends_on`: service_started = the dependency's process runs; service_healthy = its health is
  healthy (unhealthy first: the start fails, as compose's "dependency failed to start");
  service_completed_successfully = it exited 0.
- `stop_signal` (or the image's STOPSIGNAL, else SIGTERM) and `stop_grace_period` (default 10s):
  `down` stops services in the reverse of their start order, each with that signal, then SIGKILL.
- `cap_drop: [ALL]` and `security_opt: no-new-privileges`: honoured, for the services and their
  healthchecks, through setpriv (host_process.NO_PRIVILEGES).
- Ignored, each with its reason in IGNORED: `init`, `restart`, `logging`, `build` args, `expose`,
  `user`/USER (root without capabilities instead), `:ro` (not enforced without a mount
  namespace); `devices`/`ulimits`/`group_add` are commented out in the file.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from host_process import NO_PRIVILEGES, HostProcess, PathMap, Stopped, default_path, signal_number, start
from netns import Network


class ComposeError(Exception):
    """The compose file (or the harness's reading of it) cannot be run; compose would refuse too."""


# ---- interpolation and env files --------------------------------------------------------------

_VARIABLE = re.compile(r"\$(?:(\$)|\{(\w+)(?:(:?[-?])((?:[^{}]|\{[^{}]*\})*))?\}|(\w+))")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's variable substitution in one string."""
    def substitute(match: re.Match) -> str:
        escaped, name, op, arg, bare = match.groups()
        if escaped:
            return "$"
        if bare:
            return env.get(bare, "")
        value = env.get(name)
        unset_or_empty = value is None or (op is not None and op.startswith(":") and value == "")
        if op in (":-", "-"):
            return interpolate(arg, env) if unset_or_empty else value
        if op in (":?", "?"):
            if unset_or_empty:
                raise ComposeError(f"required variable {name} is missing a value: {arg}")
            return value
        return value or ""
    return _VARIABLE.sub(substitute, text)


def interpolate_tree(node: object, env: Mapping[str, str]) -> object:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [interpolate_tree(item, env) for item in node]
    if isinstance(node, dict):
        return {key: interpolate_tree(value, env) for key, value in node.items()}
    return node


def read_env_file(path: Path) -> dict[str, str]:
    """A compose env file (--env-file, env_file:): KEY=VALUE lines, # comments, a value in matching
    quotes loses them."""
    env = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ComposeError(f"{path}: {raw!r} is not KEY=VALUE")
        value = value.strip()
        if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def fill_example(example: Path, values: Mapping[str, str]) -> str:
    """The text of an example env file (compose's or systemd's) with `values` put in place of the
    example's, comments kept; each key must be one the example documents."""
    text, missing = example.read_text(), set(values)
    lines = []
    for line in text.splitlines():
        key = line.split("=", 1)[0].strip()
        if "=" in line and not line.lstrip().startswith("#") and key in values:
            line = f"{key}={values[key]}"
            missing.discard(key)
        lines.append(line)
    assert not missing, f"{example.name} does not document {sorted(missing)}"
    return "\n".join(lines) + "\n"


def duration(value: str | int | float) -> float:
    """A compose duration: 1m30s, 500ms, 10s, 2h (a bare number is seconds)."""
    if isinstance(value, (int, float)):
        return float(value)
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", value)
    if not parts or "".join(n + u for n, u in parts) != value.strip():
        raise ComposeError(f"{value!r} is not a duration")
    return sum(float(n) * scale[u] for n, u in parts)


# ---- Dockerfiles ------------------------------------------------------------------------------

@dataclass
class Dockerfile:
    path: Path
    instructions: list[tuple[str, str]]

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def final_stage(self) -> "Dockerfile":
        starts = [i for i, (kw, _) in enumerate(self.instructions) if kw == "FROM"]
        return Dockerfile(self.path, self.instructions[starts[-1]:])


def read_dockerfile(path: Path) -> Dockerfile:
    """Instructions as (KEYWORD, arguments), continuation lines joined, comments dropped."""
    instructions, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, args = line.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    return Dockerfile(path, instructions)


def _exec_or_shell(args: str) -> list[str]:
    """ENTRYPOINT/CMD arguments: exec form (JSON) as is, shell form under /bin/sh -c."""
    args = args.strip()
    return json.loads(args) if args.startswith("[") else ["/bin/sh", "-c", args]


@dataclass
class Image:
    """What running a container takes from its image."""
    entrypoint: list[str]
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    volumes: list[str] = field(default_factory=list)
    healthcheck: dict = field(default_factory=dict)   # compose's keys: test, interval, ...
    stop_signal: str = "SIGTERM"
    user: str = "root"


def image_from_dockerfile(path: Path) -> Image:
    final = read_dockerfile(path).final_stage()
    env = {"PATH": default_path()}
    for args in final.all("ENV"):
        words = shlex.split(args)
        pairs = [w.split("=", 1) for w in words] if "=" in words[0] else [[words[0], " ".join(words[1:])]]
        for key, value in pairs:
            env[key] = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), value)
    image = Image(entrypoint=_exec_or_shell(final.all("ENTRYPOINT")[-1]) if final.all("ENTRYPOINT") else [],
                  cmd=_exec_or_shell(final.all("CMD")[-1]) if final.all("CMD") else [], env=env,
                  workdir=(final.all("WORKDIR") or ["/"])[-1],
                  volumes=[v for args in final.all("VOLUME")
                           for v in (json.loads(args) if args.startswith("[") else args.split())],
                  stop_signal=(final.all("STOPSIGNAL") or ["SIGTERM"])[-1],
                  user=(final.all("USER") or ["root"])[-1])
    for args in final.all("HEALTHCHECK")[-1:]:
        if args.strip().upper() == "NONE":
            image.healthcheck = {"test": ["NONE"]}
            continue
        options, _, command = args.partition("CMD")
        check = {"test": (["CMD", *json.loads(command)] if command.strip().startswith("[")
                          else ["CMD-SHELL", command.strip()])}
        for name, value in re.findall(r"--([\w-]+)=(\S+)", options):
            check[name.replace("-", "_")] = int(value) if name == "retries" else value
        image.healthcheck = check
    return image


# Images the compose file pulls rather than builds: what their published Dockerfiles set, with this
# machine's program for the entrypoint. Only images named here can run.
STAND_INS: dict[str, dict] = {
    # prom/prometheus: ENTRYPOINT ["/bin/prometheus"], WORKDIR /prometheus, USER nobody.
    "prom/prometheus": {"program": "prometheus", "workdir": "/prometheus"},
}
NO_STAND_IN = {
    "grafana/grafana": "Grafana ships as an image (or a tarball), not as a Debian package: no "
                       "binary to run here",
}


# ---- the plan: each service as a host process -------------------------------------------------

# Keys of a service that change nothing here, and why (`Project.plans[s].ignored` lists them per
# service). cap_drop and security_opt's no-new-privileges are not here: they are honoured.
IGNORED = {
    "init": "tini forwards the stop signal and reaps children; here the signal goes to the service "
            "itself and the harness reaps",
    "restart": "a service that exits fails the test instead of being restarted",
    "logging": "logs go to a file per service",
    "build": "nothing is built: the image's venv is this repository's .venv (build args with it)",
    "expose": "every port is open between the namespaces, as on compose's network",
    "image": "the tag names what runs in the container; here the stand-in or the .venv runs",
}
IGNORED_USER = "no such user here: root without capabilities instead (cap_drop: ALL)"

DEFAULT_HEALTH = {"interval": "30s", "timeout": "30s", "retries": 3, "start_period": "0s"}


@dataclass
class Healthcheck:
    test: list[str]
    interval_s: float
    timeout_s: float
    retries: int
    start_period_s: float
    start_interval_s: float

    def argv(self, mapped: PathMap) -> list[str] | None:
        kind, *rest = self.test
        if kind == "NONE":
            return None
        if kind == "CMD":
            return mapped.argv(rest)
        if kind == "CMD-SHELL":
            return ["/bin/sh", "-c", mapped(rest[0])]
        raise ComposeError(f"healthcheck test {self.test!r}")


@dataclass
class ServicePlan:
    name: str
    argv: list[str]             # mapped: runs on this machine
    env: dict[str, str]         # mapped
    cwd: Path
    paths: PathMap
    healthcheck: Healthcheck | None
    depends_on: dict[str, str]  # service -> condition
    stop_signal: int
    stop_grace_s: float
    published: list[tuple[str, int, int]]  # (host address, host port, container port)
    ignored: list[str]


def _healthcheck(service: dict, image: Image) -> Healthcheck | None:
    merged = {**DEFAULT_HEALTH, **image.healthcheck, **service.get("healthcheck", {})}
    if service.get("healthcheck", {}).get("disable") or "test" not in merged:
        return None
    test = merged["test"]
    test = ["CMD-SHELL", test] if isinstance(test, str) else list(test)
    if test[0] == "NONE":
        return None
    interval = duration(merged["interval"])
    return Healthcheck(test, interval, duration(merged["timeout"]), int(merged["retries"]),
                       duration(merged["start_period"]), duration(merged.get("start_interval", interval)))


def _depends_on(service: dict) -> dict[str, str]:
    depends = service.get("depends_on", {})
    if isinstance(depends, list):
        return {name: "service_started" for name in depends}
    return {name: spec.get("condition", "service_started") for name, spec in depends.items()}


class Project:
    """One `docker compose up` of the file: constructing it reads the file and plans each service
    (`plans`, `skipped`), up() starts them, down() stops them."""

    def __init__(self, compose_file: Path, env_file: Path, work: Path, venv: Path) -> None:
        self.compose_file, self.work, self.venv = compose_file, work, venv
        self.project_dir = compose_file.parent
        self.variables = read_env_file(env_file)
        self.config = interpolate_tree(yaml.safe_load(compose_file.read_text()), self.variables)
        self.skipped: dict[str, str] = {}
        self._rewrite_later: list[tuple[Path, PathMap]] = []
        self.plans = {name: self._plan(name, service) for name, service in self.config["services"].items()
                      if not self._skip(name, service)}
        self.net: Network | None = None
        self.running: dict[str, HostProcess] = {}
        self.health: dict[str, "HealthMonitor"] = {}
        self.events: list[tuple[float, str, str]] = []  # (monotonic time, service, what)

    # -- reading --

    def _skip(self, name: str, service: dict) -> bool:
        if "build" in service:
            return False
        image = service["image"].split(":")[0]
        if image in STAND_INS and shutil.which(STAND_INS[image]["program"]):
            return False
        self.skipped[name] = NO_STAND_IN.get(image) or f"{image}: {STAND_INS.get(image, {}).get('program', 'no stand-in')} is not installed"
        return True

    def _image(self, service: dict) -> Image:
        if "build" in service:
            context = self.project_dir / service["build"].get("context", ".")
            return image_from_dockerfile(context / service["build"].get("dockerfile", "Dockerfile"))
        stand_in = STAND_INS[service["image"].split(":")[0]]
        return Image(entrypoint=[shutil.which(stand_in["program"])], workdir=stand_in["workdir"],
                     env={"PATH": default_path()})

    def _plan(self, name: str, service: dict) -> ServicePlan:
        image = self._image(service)
        root = self.work / name
        paths = PathMap()
        if "VIRTUAL_ENV" in image.env:
            paths.add(image.env["VIRTUAL_ENV"], self.venv)
        secrets = root / "secrets"
        secrets.mkdir(parents=True)
        for secret in service.get("secrets", []):
            source, target = (secret, secret) if isinstance(secret, str) else \
                (secret["source"], secret.get("target", secret["source"]))
            shutil.copy2(self.project_dir / self.config["secrets"][source]["file"], secrets / target)
        paths.add("/run/secrets", secrets)
        for volume in service.get("volumes", []):
            self._mount(name, volume, paths)
        for folder in image.volumes:
            if paths(folder) == folder:
                paths.add(folder, self._folder(root / "anonymous" / folder.strip("/")))
        # The image's own folders: where it works and what its ENV points at (not PATH: the
        # programs it names are this machine's, the image's venv aside). Shortest first, so that
        # /var/cache/ttserve/vllm lands inside /var/cache/ttserve's folder.
        own = {image.workdir, *(v for k, v in image.env.items() if k != "PATH")}
        for folder in sorted((p for p in own if p.startswith("/") and p != "/"), key=len):
            if paths(folder) == folder:
                paths.add(folder, self._folder(root / "rootfs" / folder.strip("/")))
        env = dict(image.env)
        for env_file in service.get("env_file", []):
            env.update(read_env_file(self.project_dir / env_file))
        environment = service.get("environment", {})
        if isinstance(environment, list):
            environment = dict(item.split("=", 1) for item in environment)
        env.update({k: "" if v is None else str(v) for k, v in environment.items()})
        command = service.get("command", image.cmd)
        command = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
        entrypoint = service.get("entrypoint", image.entrypoint)
        argv = paths.argv([*entrypoint, *command])
        for arg in argv[1:]:
            path = arg.split("=", 1)[-1]
            if path.startswith("/") and not Path(path).exists():
                raise ComposeError(f"{name}: {path} (from {arg}) is not mapped onto this machine")
        ignored = [f"{key}: {reason}" for key, reason in IGNORED.items() if key in service]
        ignored.append(f"user {service.get('user', image.user)}: {IGNORED_USER}")
        ignored += [f"{volume}: read-only is not enforced (no mount namespace)"
                    for volume in service.get("volumes", []) if str(volume).endswith(":ro")]
        published = []
        for port in service.get("ports", []):
            *address, host_port, container_port = str(port).split(":")
            published.append((address[0] if address else "0.0.0.0", int(host_port), int(container_port)))
        return ServicePlan(name, argv, paths.env(env), Path(paths(image.workdir)), paths,
                           _healthcheck(service, image), _depends_on(service),
                           signal_number(service.get("stop_signal", image.stop_signal)),
                           duration(service.get("stop_grace_period", "10s")), published, ignored)

    @staticmethod
    def _folder(path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _mount(self, name: str, volume: str | dict, paths: PathMap) -> None:
        if isinstance(volume, dict):
            source, target, read_only = volume.get("source", ""), volume["target"], volume.get("read_only", False)
        else:
            source, target, *mode = volume.split(":")
            read_only = "ro" in (mode[0].split(",") if mode else [])
        if not source.startswith((".", "/", "~")):  # a named volume, shared by the services naming it
            paths.add(target, self._folder(self.work / "volumes" / source))
            return
        host = (self.project_dir / os.path.expanduser(source)).resolve()
        if read_only and host.is_dir() and host.is_relative_to(self.project_dir.parent):
            # Configuration shipped in this repository: a copy in which the files' own container
            # paths (prometheus.yml's /run/secrets/...) are mapped too; the paths are final once
            # the service's other mounts are known, so the copy is rewritten in up().
            copy = self.work / name / "config" / target.strip("/")
            shutil.copytree(host, copy)
            paths.add(target, copy)
            self._rewrite_later.append((copy, paths))
            return
        paths.add(target, host)

    # -- running --

    def up(self, net: Network, timeout_s: float) -> None:
        """Starts every planned service once its depends_on conditions hold (like `docker compose
        up --wait`, waits until each service with a healthcheck is healthy); raises
        ComposeError on a failed dependency, a service that exits, or after `timeout_s`."""
        self.net = net
        for copy, paths in self._rewrite_later:
            for file in copy.rglob("*"):
                if file.is_file():
                    file.write_text(paths(file.read_text()))
        self._rewrite_later.clear()
        deadline = time.monotonic() + timeout_s
        pending = [name for name in self.plans]  # file order, as compose lists them
        while pending or not self.all_healthy():
            for name in list(pending):
                if self._may_start(name):
                    self._start(name)
                    pending.remove(name)
            for name, status in self.exited().items():
                raise ComposeError(f"{name} exited with status {status}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise ComposeError(f"not up after {timeout_s:.0f} s: waiting for {pending or 'health'}; "
                                   f"health {self.states()}\n{self.logs()}")
            time.sleep(0.2)

    def _may_start(self, name: str) -> bool:
        for dependency, condition in self.plans[name].depends_on.items():
            if dependency in self.skipped:
                raise ComposeError(f"{name} depends on {dependency}, which is skipped: {self.skipped[dependency]}")
            if dependency not in self.running:
                return False
            process = self.running[dependency]
            if condition == "service_started":
                ok = process.alive()
            elif condition == "service_healthy":
                state = self.health[dependency].state if dependency in self.health else None
                if state is None:
                    raise ComposeError(f"{name}: service_healthy on {dependency}, which has no healthcheck")
                if state == "unhealthy":
                    raise ComposeError(f"dependency failed to start: {dependency} is unhealthy\n{self.logs()}")
                ok = state == "healthy"
            elif condition == "service_completed_successfully":
                ok = process.proc.poll() == 0
            else:
                raise ComposeError(f"{name}: unknown depends_on condition {condition}")
            if not ok:
                return False
        return True

    def _start(self, name: str) -> None:
        plan = self.plans[name]
        logs = self._folder(self.work / "logs")
        self.running[name] = start(self.net, name, name, plan.argv, plan.env, cwd=plan.cwd, log_dir=logs)
        self.events.append((time.monotonic(), name, "started"))
        if plan.healthcheck:
            self.health[name] = HealthMonitor(self, name)

    def all_healthy(self) -> bool:
        return all(monitor.state == "healthy" for monitor in self.health.values()) and \
            len(self.running) == len(self.plans)

    def states(self) -> dict[str, str]:
        return {name: monitor.state for name, monitor in self.health.items()}

    def exited(self) -> dict[str, int | None]:
        """The started services whose process has exited, with its status."""
        return {name: process.proc.returncode for name, process in self.running.items() if not process.alive()}

    def logs(self) -> str:
        return "\n".join(f"--- {name} ---\n{process.output()}" for name, process in self.running.items())

    def down(self) -> dict[str, Stopped]:
        """Stops the running services in the reverse of their start order, each with its
        stop_signal and stop_grace_period (then SIGKILL). Idempotent."""
        for monitor in self.health.values():
            monitor.stop()
        stopped = {}
        for name in reversed(list(self.running)):
            plan = self.plans[name]
            stopped[name] = self.running[name].stop(plan.stop_signal, plan.stop_grace_s)
            self.events.append((time.monotonic(), name, "stopped"))
        return stopped

    @contextlib.contextmanager
    def inside(self, name: str) -> Iterator[None]:
        """The calling thread where a published port of `name` leads (see the module docstring)."""
        assert self.net is not None and self.plans[name].published, f"{name} publishes no port"
        with self.net.inside(name):
            yield


class HealthMonitor:
    """Docker's health state machine for one service, probing in its own thread."""

    def __init__(self, project: Project, name: str) -> None:
        self.project, self.name = project, name
        self.check = project.plans[name].healthcheck
        self.state = "starting"
        self.probes: list[tuple[float, int | None, str]] = []  # (time, exit status or None: timed out, output)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"health-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        plan = self.project.plans[self.name]
        started = self.project.running[self.name].started
        failures, ever_healthy = 0, False
        argv = self.check.argv(plan.paths)
        while True:
            in_start_period = not ever_healthy and time.monotonic() - started < self.check.start_period_s
            wait = self.check.start_interval_s if in_start_period else self.check.interval_s
            if self._stopped.wait(wait):
                return
            try:
                # As `docker exec` runs it: the container's environment, directory, privileges.
                done = self.project.net.run(self.name, [*NO_PRIVILEGES, *argv], env=plan.env, cwd=plan.cwd, capture_output=True,
                                            text=True, timeout=self.check.timeout_s)
                status, output = done.returncode, (done.stdout + done.stderr)[-2000:]
            except subprocess.TimeoutExpired:
                status, output = None, f"timed out after {self.check.timeout_s} s"
            now = time.monotonic()
            self.probes.append((now, status, output))
            if status == 0:
                failures, ever_healthy, self.state = 0, True, "healthy"
                if not any(e[1] == self.name and e[2] == "healthy" for e in self.project.events):
                    self.project.events.append((now, self.name, "healthy"))
            elif ever_healthy or now - started >= self.check.start_period_s:
                failures += 1
                if failures >= self.check.retries:
                    self.state = "unhealthy"

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=self.check.timeout_s + 5)
