"""The deployment files executed: deploy/docker-compose.yml by tests/compose_harness.py and
deploy/systemd by tests/systemd_harness.py, each serving a real chat completion over HTTPS with
the API key, then stopped as `docker compose down` / `systemctl stop ttserve.target` stop them.

Needs root and network namespaces (tests/netns.py; skipped without, failed with
TTSERVE_REQUIRE_OPS_TOOLS=1) and openssl for deploy/make-certs.sh. Prometheus runs where Debian's
`prometheus` is installed (CI); Grafana never (see compose_harness.NO_STAND_IN).
"""
from __future__ import annotations

import contextlib
import json
import secrets
import signal
import ssl
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from compose_harness import NO_STAND_IN, ComposeError, Project, fill_example
from netns import Network, require_netns
from stack import REQUIRE_OPS_TOOLS, require_tool
from systemd_harness import Host, Run, load_units, one, restart_decision, seconds, transaction

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
VENV = ROOT / ".venv"
SERVICES = ("worker", "control", "gateway")
# A bounded wait for a stack to come up: SmolLM2 on the CPU loads, warms up and the gateway
# imports vLLM in well under this on two busy cores; healthchecks probe every 10 s.
UP_TIMEOUT_S = 240


def make_certs(folder: Path, *services: str) -> Path:
    """deploy/make-certs.sh as the deployment docs run it: the CA, a certificate per service,
    the API key."""
    require_tool("openssl")
    done = subprocess.run(["bash", str(DEPLOY / "make-certs.sh"), str(folder), *services],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return folder


def chat(base_url: str, ca: Path, api_key: str) -> str:
    """One chat completion through the gateway with the openai client: HTTPS verified against
    the CA, the key as a bearer token. The reply's text."""
    import httpx
    import openai

    # Closed on the way out: an idle keep-alive TLS connection left open holds the gateway's stop
    # for its whole uvicorn timeout_graceful_shutdown (5 s) at the later `down` / `systemctl stop`.
    with openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120,
                       http_client=httpx.Client(verify=ssl.create_default_context(cafile=str(ca)))) as client:
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, max_tokens=12, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
    return reply.choices[0].message.content


def https_get(url: str, ca: Path, api_key: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=5, context=ssl.create_default_context(cafile=str(ca))) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


# ---- docker compose ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose(tmp_path_factory, smollm2) -> Iterator[Project]:
    require_netns()
    tmp = tmp_path_factory.mktemp("compose")
    tls = make_certs(tmp / "tls")  # the compose header: deploy/make-certs.sh /srv/ttserve-tls
    env_file = tmp / "compose.env"  # as compose.env.example says: a copy, filled in
    env_file.write_text(fill_example(DEPLOY / "docker" / "compose.env.example", {
        "TTSERVE_MODELS_DIR": str(smollm2.parent), "TTSERVE_MODEL": smollm2.name,
        "TTSERVE_BACKEND": "auto", "GRAFANA_ADMIN_PASSWORD": secrets.token_hex(8),
        "TTSERVE_TLS_DIR": str(tls)}))
    project = Project(DEPLOY / "docker-compose.yml", env_file, tmp / "run", VENV)
    with Network(list(project.plans)) as net:
        try:
            project.up(net, UP_TIMEOUT_S)
            yield project
        finally:
            project.down()


def worker_ready() -> bool:
    with urllib.request.urlopen("http://127.0.0.1:9402/ready", timeout=5) as r:
        return json.loads(r.read())["ok"] is True


def tls_dir(project: Project) -> Path:
    return Path(project.variables["TTSERVE_TLS_DIR"])


def test_compose_env_example_names_every_required_variable(tmp_path):
    """Without the env file's values compose refuses the file, naming the variable."""
    empty = tmp_path / "compose.env"
    empty.write_text("")
    with pytest.raises(ComposeError, match="TTSERVE_MODEL"):
        Project(DEPLOY / "docker-compose.yml", empty, tmp_path / "run", VENV)


@pytest.mark.e2e
def test_compose_starts_in_the_order_depends_on_allows(compose):
    events = {(service, what): t for t, service, what in compose.events}
    for service, dependency in (("control", "worker"), ("gateway", "control")):
        assert compose.plans[service].depends_on == {dependency: "service_healthy"}
        assert events[(dependency, "healthy")] < events[(service, "started")], compose.events
    # The healthchecks ran as written (python -c urllib ... /health) and passed.
    for service in SERVICES:
        probes = compose.health[service].probes
        assert probes and probes[-1][1] == 0, probes
        assert "/health" in " ".join(compose.plans[service].healthcheck.test)
    # Readiness follows liveness: the control plane, once started, warms the worker up.
    wait_for(worker_ready, lambda: compose.net.inside("worker"), "the worker to be ready",
             compose.logs, compose.exited)


@pytest.mark.e2e
def test_compose_serves_a_chat_completion_through_the_gateway(compose):
    key = (tls_dir(compose) / "api-key").read_text().strip()
    with compose.inside("gateway"):  # where the published port 8000:8000 leads
        assert https_get("https://127.0.0.1:8000/v1/models", tls_dir(compose) / "ca.crt") == 401, "the key is required"
    # Healthy is not ready: the gateway answers /health (and 503s) while the worker warms up, as
    # deploy/README.md says, so a client waits for /ready as a balancer would.
    wait_for(lambda: https_get("https://127.0.0.1:8000/ready", tls_dir(compose) / "ca.crt", key) == 200,
             lambda: compose.inside("gateway"), "the gateway to be ready", compose.logs, compose.exited)
    with compose.inside("gateway"):
        text = chat("https://127.0.0.1:8000/v1", tls_dir(compose) / "ca.crt", key)
    assert text.strip(), "an empty reply"


@pytest.mark.e2e
def test_compose_prometheus_scrapes_the_services(compose):
    if "prometheus" in compose.skipped:
        require_tool("prometheus")
    with compose.inside("prometheus"):
        assert urllib.request.urlopen("http://127.0.0.1:9090/-/ready", timeout=5).status == 200
        deadline, up = time.monotonic() + 60, {}
        while time.monotonic() < deadline:
            query = urllib.parse.urlencode({"query": "up"})
            with urllib.request.urlopen(f"http://127.0.0.1:9090/api/v1/query?{query}", timeout=5) as r:
                up = {s["metric"]["job"]: s["value"][1] for s in json.loads(r.read())["data"]["result"]}
            if all(up.get(f"ttserve-{s}") == "1" for s in SERVICES):
                break
            time.sleep(2)
    assert all(up.get(f"ttserve-{s}") == "1" for s in SERVICES), up


@pytest.mark.e2e
def test_compose_runs_all_but_grafana(compose):
    expected = {"grafana"} | ({"prometheus"} if "prometheus" in compose.skipped else set())
    assert set(compose.skipped) == expected, compose.skipped
    assert compose.skipped["grafana"] == NO_STAND_IN["grafana/grafana"]
    if REQUIRE_OPS_TOOLS:
        assert "prometheus" in compose.plans, compose.skipped


@pytest.mark.e2e
def test_compose_down_drains_each_service_within_its_grace_period(compose):
    order = list(compose.running)
    stopped = compose.down()
    assert list(stopped) == list(reversed(order))
    for name, result in stopped.items():
        grace = compose.plans[name].stop_grace_s
        assert result.returncode == 0 and not result.killed and result.seconds < grace, (name, result)


# ---- systemd ----------------------------------------------------------------------------------

ENABLED = ["ttserve-worker.service", "ttserve-control.service", "ttserve-gateway.service", "ttserve.target"]


def install(root: Path, model: Path, **args: str) -> Path:
    """/etc/ttserve as deploy/README.md installs it: the env files from the examples with this
    test's values, the certificates and key from make-certs.sh under /etc/ttserve/tls."""
    etc = root / "etc" / "ttserve"
    etc.mkdir(parents=True)
    make_certs(etc / "tls", "worker", "control", "gateway")
    flags = {
        # The example's flags, but SmolLM2 on the CPU: auto finds no chips, and no tt options.
        "worker": f"--host 127.0.0.1 --port 50061 --control-identity control --model {model} --backend auto",
        "control": "--host 127.0.0.1 --port 50051 --worker 127.0.0.1:50061 --max-num-seqs 32 "
                   "--max-num-batched-tokens 2048 --enable-prefix-caching",
        "gateway": f"--host 0.0.0.0 --port 8000 --control 127.0.0.1:50051 --model {model} "
                   "--served-model-name smollm2",
    }
    flags.update(args)
    for service in SERVICES:
        values = {f"TTSERVE_{service.upper()}_ARGS": flags[service]}
        if service == "worker":
            values.update(MESH_DEVICE="", TT_VISIBLE_DEVICES="")
        (etc / f"{service}.env").write_text(fill_example(DEPLOY / "systemd" / f"{service}.env.example", values))
    return root


@pytest.fixture
def host_network() -> Iterator[Network]:
    require_netns()
    with Network(["host"]) as net:
        yield net


def test_units_start_in_dependency_order():
    units = load_units(DEPLOY / "systemd", ENABLED)
    assert transaction("ttserve.target", units, ENABLED) == [
        "ttserve-worker.service", "ttserve-control.service", "ttserve-gateway.service", "ttserve.target"]
    # Template instances instead of the single-worker unit (masked): every instance first.
    instances = ["ttserve-worker@0.service", "ttserve-worker@1.service", *ENABLED[1:]]
    units = load_units(DEPLOY / "systemd", instances)
    order = transaction("ttserve.target", units, instances)
    assert order[:2] == instances[:2] and order.index("ttserve-control.service") == 2, order
    assert "ttserve-worker.service" not in order


def test_restart_settings_match_the_exit_statuses():
    """Exit status 2 is a refused flag or an unreadable file: restarting cannot help, so it is
    never retried; any other failure (1, a signal) is, after RestartSec=, up to the limit."""
    for name in ENABLED[:3]:
        unit = load_units(DEPLOY / "systemd", ENABLED)[name]
        assert restart_decision(unit, 2, [0.0], 1.0) is None
        assert restart_decision(unit, 0, [0.0], 1.0) is None, "a drained exit 0 stays stopped"
        assert isinstance(restart_decision(unit, 1, [0.0], 1.0), float)
        assert isinstance(restart_decision(unit, -signal.SIGKILL, [0.0], 1.0), float)
        assert restart_decision(unit, 1, [0.0, 1.0, 2.0, 3.0, 4.0], 5.0) == "limit"


@pytest.mark.e2e
def test_systemd_units_serve_restart_and_stop(tmp_path, smollm2, host_network):
    root = install(tmp_path, smollm2)
    host = Host(DEPLOY / "systemd", root, VENV, host_network, "host", ENABLED)
    try:
        order = host.start()
        assert [n for n in order if n.endswith(".service")] == ENABLED[:3]
        tls = root / "etc" / "ttserve" / "tls"
        key = (tls / "api-key").read_text().strip()

        def on_host(check: Callable[[], bool], what: str) -> None:
            wait_for(check, lambda: host_network.inside("host"), what, host.logs,
                     lambda: {n: r.failed for n, r in host.runs.items() if r.failed})

        def serves_a_chat(when: str) -> None:
            on_host(lambda: https_get("https://127.0.0.1:8000/ready", tls / "ca.crt", key) == 200,
                    f"the gateway to be ready {when}")
            with host_network.inside("host"):
                assert chat("https://127.0.0.1:8000/v1", tls / "ca.crt", key).strip()

        serves_a_chat("after the start")
        # The units' restart policy in action: the control plane killed (a failure) comes back
        # after RestartSec=, and the gateway serves through it again.
        control = host.runs["ttserve-control.service"]
        control.current.proc.kill()
        on_host(lambda: len(control.processes) == 2 and control.current.alive(),
                "the control plane to be restarted")
        serves_a_chat("after the control plane's restart")
        stopped = host.stop()
        assert list(stopped) == list(reversed(ENABLED[:3]))
        for name, result in stopped.items():
            limit = seconds(one(host.units[name].sections, "Service", "TimeoutStopSec"))
            assert result.returncode == 0 and not result.killed and result.seconds < limit, (name, result)
        assert not any(run.failed for run in host.runs.values()), {n: r.failed for n, r in host.runs.items()}
    finally:
        host.close()


def wait_for(check: Callable[[], bool], inside: Callable[[], contextlib.AbstractContextManager[None]],
             what: str, logs: Callable[[], str], failed: Callable[[], dict[str, object]] = dict,
             timeout: float = UP_TIMEOUT_S) -> None:
    """Until check() (run `inside` the namespace it needs) is true; fails at once when failed()
    names a service its supervisor has given up on. logs() is read only on failure."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gave_up = failed()
        assert not gave_up, f"{gave_up} while waiting for {what}\n{logs()}"
        try:
            with inside():
                if check():
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}\n{logs()}")


@contextlib.contextmanager
def one_unit(root: Path, net: Network, name: str) -> Iterator[tuple[Host, Run]]:
    """`systemctl start name` alone (its Wants= not pulled in), stopped on the way out."""
    host = Host(DEPLOY / "systemd", root, VENV, net, "host", ENABLED)
    try:
        host.start_unit(name)
        yield host, host.runs[name]
    finally:
        host.close()


def settle(done, timeout: float) -> None:
    """Until done() (the supervisor's decisions land every 0.2 s), at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["refused flag", "key file not PEM"])
def test_systemd_exit_status_2_is_not_restarted(tmp_path, smollm2, host_network, case):
    """A refused flag and a file that cannot be used (README, Security: "Bad files stop start-up
    with one line and exit status 2") both exit 2 at once, and the unit stays failed instead of
    looping through restarts."""
    root = install(tmp_path, smollm2, control="--worker 127.0.0.1:50061 --no-such-flag"
                   if case == "refused flag" else "--worker 127.0.0.1:50061")
    if case == "key file not PEM":
        (root / "etc" / "ttserve" / "tls" / "control.key").write_text("not a key\n")
    with one_unit(root, host_network, "ttserve-control.service") as (host, run):
        settle(lambda: run.failed, 60)
        assert run.exits == [2] and "no restart" in run.failed, (run.exits, run.failed, host.logs())
        time.sleep(3)  # past RestartSec=2: still one start
        assert len(run.processes) == 1


@pytest.mark.e2e
def test_systemd_gateway_without_a_control_plane_is_restarted(tmp_path, smollm2, host_network):
    """An absent control plane is transient, not a refused flag: a gateway that gives up on it
    (--connect-timeout) exits with a status other than 2, so Restart=on-failure tries again
    after RestartSec= (RestartPreventExitStatus=2 would leave it dead for good)."""
    root = install(tmp_path, smollm2, gateway=f"--host 0.0.0.0 --port 8000 --control 127.0.0.1:50051 "
                                              f"--model {smollm2} --connect-timeout 2")
    with one_unit(root, host_network, "ttserve-gateway.service") as (host, run):
        settle(lambda: len(run.processes) >= 2 or run.failed, 90)
        assert run.exits and run.exits[0] not in (0, 2) and not run.failed, (run.exits, run.failed, host.logs())
        assert len(run.processes) == 2, "restarted after RestartSec="
