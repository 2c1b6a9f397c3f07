"""Checks of the deployment files under deploy/: fast, no service is started.

Tool-based checks (promtool, systemd-analyze, docker-compose) skip when the tool is missing, unless
TTSERVE_REQUIRE_OPS_TOOLS=1 (CI) turns a missing tool into a failure. The rest parse the files
and cross-check them against each other, against the services' own flag parsers and against the
metric catalog of docs/metrics.md, which is the authority for metric names.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from compose_harness import duration, interpolate, read_dockerfile
from stack import DEFAULT_SHUTDOWN_TIMEOUT_S, REQUIRE_OPS_TOOLS, require_tool
# The units' and environment files' readers are the ones tests/systemd_harness.py runs them with.
from systemd_harness import (INSTALLED_BINARY, expand_exec_args, one, parse_env_text, read_env_file,
                             read_unit, seconds, values, words)

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SYSTEMD = DEPLOY / "systemd"
DOCKER = DEPLOY / "docker"
PROMETHEUS = DEPLOY / "prometheus"
GRAFANA = DEPLOY / "grafana"
COMPOSE = DEPLOY / "docker-compose.yml"
DASHBOARD = GRAFANA / "dashboards" / "ttserve.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"

SERVICES = ("worker", "control", "gateway")
# Ports: docs/metrics.md and the services' flag defaults.
HTTP_PORT = {"gateway": 8000, "control": 9401, "worker": 9402}
GRPC_PORT = {"control": 50051, "worker": 50061}
PROMETHEUS_JOB = {"gateway": "ttserve-gateway", "control": "ttserve-control", "worker": "ttserve-worker"}

def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kwargs)


def output(done: subprocess.CompletedProcess) -> str:
    return f"$ {shlex.join(done.args)}\nexit {done.returncode}\n{done.stdout}{done.stderr}"


# ---- the metric catalog (docs/metrics.md) -------------------------------------------------------

@dataclass(frozen=True)
class Metric:
    name: str
    type: str            # counter | gauge | histogram
    labels: frozenset[str]
    service: str         # control | worker | gateway

    def series(self) -> dict[str, frozenset[str]]:
        """The series names this metric exposes, with the labels each carries."""
        if self.type == "histogram":
            return {f"{self.name}_bucket": self.labels | {"le"}, f"{self.name}_sum": self.labels,
                    f"{self.name}_count": self.labels}
        return {self.name: self.labels}


_SECTION = {"Control plane": "control", "Worker": "worker", "Gateway": "gateway"}


def load_catalog() -> dict[str, Metric]:
    """Every metric of the catalog tables, by name; the section names the exporting service."""
    catalog: dict[str, Metric] = {}
    service = None
    for line in METRICS_DOC.read_text().splitlines():
        heading = re.match(r"^## (\w[\w ]*?)\s*(\(|$)", line)
        if heading:
            service = _SECTION.get(heading.group(1).strip())
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if service is None or len(cells) < 3 or not cells[0].startswith("`ttserve_"):
            continue
        name = cells[0].strip("`")
        kind = cells[1].split()[0]
        labels = frozenset(label.strip() for label in cells[2].split(",") if label.strip())
        assert kind in ("counter", "gauge", "histogram"), f"{name}: unknown type {cells[1]!r}"
        assert name not in catalog, f"{name} is listed twice in docs/metrics.md"
        catalog[name] = Metric(name, kind, labels, service)
    return catalog


CATALOG = load_catalog()


def prometheus_config() -> dict:
    return yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())


def target_labels() -> dict[str, set[str]]:
    """Labels Prometheus attaches per service: job, instance and static_configs labels."""
    jobs = {job["job_name"]: job for job in prometheus_config()["scrape_configs"]}
    out = {}
    for service, job in PROMETHEUS_JOB.items():
        labels = {"job", "instance"}
        for static in jobs.get(job, {}).get("static_configs", []):
            labels |= set(static.get("labels", {}))
        out[service] = labels
    return out


def exposed_series() -> dict[str, frozenset[str]]:
    """Series name -> every label it can carry once scraped."""
    extra = target_labels()
    series: dict[str, frozenset[str]] = {}
    for metric in CATALOG.values():
        for name, labels in metric.series().items():
            series[name] = labels | extra[metric.service]
    series["up"] = frozenset({"job", "instance"}) | set().union(*extra.values())
    return series


def recording_rules() -> dict[str, str]:
    groups = yaml.safe_load((PROMETHEUS / "rules.yml").read_text())["groups"]
    return {rule["record"]: rule["expr"] for group in groups for rule in group["rules"]}


def alerting_rules() -> list[dict]:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


# ---- a small PromQL reader: which series and labels an expression names -------------------------

_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_SELECTOR = re.compile(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^{}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)")
_IDENT = re.compile(r"(?<![\w:.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
             "group_left", "group_right", "inf", "nan", "atan2"}


@dataclass
class PromQLRefs:
    names: set[str] = field(default_factory=set)                     # series named
    matchers: list[tuple[str, str]] = field(default_factory=list)   # (series, label) in {...}
    grouping: set[str] = field(default_factory=set)                 # labels in by/on/...


def promql_refs(expr: str) -> PromQLRefs:
    refs = PromQLRefs()
    text = _STRING.sub('""', expr)
    for selector in _SELECTOR.finditer(text):
        name = selector.group(1)
        for matcher in _MATCHER.finditer(selector.group(2)):
            label = matcher.group(1)
            if label == "__name__":
                continue
            refs.matchers.append((name or "", label))
    text = _SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", text)
    for group in _GROUPING.finditer(text):
        refs.grouping |= {label.strip() for label in group.group(2).split(",") if label.strip()}
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)   # ranges and subqueries: [5m], [$__rate_interval]
    for ident in _IDENT.finditer(text):
        word = ident.group(1)
        if word not in _KEYWORDS:
            refs.names.add(word)
    return refs


def test_promql_reader_finds_names_and_labels():
    refs = promql_refs('histogram_quantile(0.99, sum by (kind, le) (rate(ttserve_step_rtt_seconds_bucket'
                       '{worker=~"$worker", kind!="x{y}"}[$__rate_interval]))) > 1e3 '
                       'and on (worker) ttserve_worker_up offset 5m')
    assert refs.names == {"ttserve_step_rtt_seconds_bucket", "ttserve_worker_up"}
    assert refs.matchers == [("ttserve_step_rtt_seconds_bucket", "worker"),
                             ("ttserve_step_rtt_seconds_bucket", "kind")]
    assert refs.grouping == {"kind", "le", "worker"}


def check_expr(expr: str, known: dict[str, frozenset[str]], where: str) -> list[str]:
    """Problems of one expression: names outside `known`, labels its series cannot carry."""
    refs = promql_refs(expr)
    problems = [f"{where}: {name!r} is not a metric of docs/metrics.md (nor a recorded series)"
                for name in sorted(refs.names - set(known))]
    for name, label in refs.matchers:
        if name in known and label not in known[name]:
            problems.append(f"{where}: {name} has no label {label!r} (it has {sorted(known[name])})")
    every_label = set().union(*known.values())
    problems += [f"{where}: no metric has the label {label!r}" for label in sorted(refs.grouping - every_label)]
    return problems


def known_series() -> dict[str, frozenset[str]]:
    """Catalog series plus recorded series; a recorded series carries what its expression keeps
    (approximated by every label its sources carry)."""
    known = dict(exposed_series())
    for record, expr in recording_rules().items():
        refs = promql_refs(expr)
        labels = frozenset().union(*(known.get(name, frozenset()) for name in refs.names))
        known[record] = labels
    return known


def dependencies(expr: str, rules: dict[str, str]) -> set[str]:
    """Series an expression depends on, through recording rules down to exported ones."""
    out, todo = set(), set(promql_refs(expr).names)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out.add(name)
        if name in rules:
            todo |= promql_refs(rules[name]).names
    return out


# ---- docs/metrics.md ----------------------------------------------------------------------------

def test_catalog_parses_and_counters_end_in_total():
    assert len(CATALOG) >= 40, f"docs/metrics.md: only {len(CATALOG)} metrics parsed; did the tables change?"
    assert {m.service for m in CATALOG.values()} == set(SERVICES)
    for metric in CATALOG.values():
        if metric.type == "counter":
            assert metric.name.endswith("_total"), f"{metric.name}: a counter is exposed as NAME_total"
        else:
            assert not metric.name.endswith("_total"), f"{metric.name}: only counters end in _total"
        assert ":" not in metric.name, f"{metric.name}: colons are for recording rules"


# ---- Prometheus -----------------------------------------------------------------------------------

def test_prometheus_config_scrapes_every_service_on_its_port():
    config = prometheus_config()
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    for service, job in PROMETHEUS_JOB.items():
        assert job in jobs, f"prometheus.yml: no scrape job {job}"
        targets = [t for static in jobs[job]["static_configs"] for t in static["targets"]]
        assert targets and all(t.endswith(f":{HTTP_PORT[service]}") for t in targets), (job, targets)
        assert jobs[job].get("metrics_path", "/metrics") == "/metrics"
    # Worker targets carry the control plane's `worker` label, so the two views join.
    for static in jobs[PROMETHEUS_JOB["worker"]]["static_configs"]:
        assert "worker" in static.get("labels", {}), static
    for rule_file in config["rule_files"]:
        assert (PROMETHEUS / rule_file).is_file(), f"rule_files: {rule_file} (relative to prometheus.yml)"
    assert set(config["rule_files"]) == {"rules.yml", "alerts.yml"}


def test_promtool_check_config_and_both_rule_files(tmp_path):
    promtool = require_tool("promtool")
    # promtool resolves rule_files relative to the config file and checks each one as
    # `promtool check rules` would (a broken rule fails the whole check), so no separate
    # `check rules` run is needed: the output must show both files checked and accepted.
    # It also opens the files a scrape job names: the compose secrets (CA, API key) exist only in
    # the running stack, so a copy of the folder points them at stand-ins.
    folder = tmp_path / "prometheus"
    shutil.copytree(PROMETHEUS, folder)
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    for name in ("ca.crt", "api-key"):
        (secrets / name).write_text("stand-in\n")
    config = folder / "prometheus.yml"
    assert "/run/secrets/" in config.read_text()
    config.write_text(config.read_text().replace("/run/secrets/", f"{secrets}/"))
    done = run([promtool, "check", "config", str(config)])
    assert done.returncode == 0, output(done)
    assert "2 rule files found" in done.stdout, output(done)
    for rule_file in ("rules.yml", "alerts.yml"):
        checked = re.search(rf"Checking {re.escape(str(folder / rule_file))}\n\s+SUCCESS: (\d+) rules found",
                            done.stdout)
        assert checked and int(checked.group(1)) > 0, f"{rule_file} was not checked\n{output(done)}"


def test_promtool_alert_unit_tests():
    promtool = require_tool("promtool")
    done = run([promtool, "test", "rules", str(PROMETHEUS / "alerts_test.yml")])
    assert done.returncode == 0, output(done)
    tested = set(re.findall(r"alertname:\s*(\w+)", (PROMETHEUS / "alerts_test.yml").read_text()))
    assert {"TtserveWorkerDown", "TtserveWorkerScrapeDown", "TtserveWorkerStalled",
            "TtserveKVCacheNearlyFull", "TtserveHighErrorRate"} <= tested


def test_recording_rules_are_named_for_the_catalog():
    """ttserve:<metric>:<operation>, where <metric> is a catalog metric without its ttserve_
    prefix (and _total), as docs/metrics.md asks."""
    bases = {m.name.removesuffix("_total") for m in CATALOG.values()}
    for record in recording_rules():
        parts = record.split(":")
        assert len(parts) == 3 and parts[0] == "ttserve" and parts[2], \
            f"{record}: name recorded series ttserve:<metric>:<operation>"
        assert f"ttserve_{parts[1]}" in bases, f"{record}: {parts[1]!r} names no metric of docs/metrics.md"
    assert "ttserve:time_to_first_token_seconds:p99_5m" in recording_rules()  # the docs' example


def test_rules_and_alerts_use_only_catalog_metrics():
    known = known_series()
    problems = []
    for record, expr in recording_rules().items():
        problems += check_expr(expr, known, f"rules.yml {record}")
    for rule in alerting_rules():
        problems += check_expr(rule["expr"], known, f"alerts.yml {rule['alert']}")
        # Metric names quoted in annotations (and queries templated into them) must exist too.
        for text in rule.get("annotations", {}).values():
            for name in re.findall(r"\bttserve[_:][a-zA-Z0-9_:]*[a-zA-Z0-9_]", text):
                if name not in known and name not in CATALOG:
                    problems.append(f"alerts.yml {rule['alert']}: annotation names unknown {name}")
    assert not problems, "\n".join(problems)


def test_alerts_cover_the_failure_modes():
    rules = recording_rules()
    alerts = alerting_rules()
    names = [rule["alert"] for rule in alerts]
    assert len(names) == len(set(names)), f"duplicate alert names: {names}"
    for rule in alerts:
        assert rule.get("labels", {}).get("severity") in ("critical", "warning"), rule["alert"]
        annotations = rule.get("annotations", {})
        assert annotations.get("summary") and annotations.get("description"), rule["alert"]
    used = [dependencies(rule["expr"], rules) for rule in alerts]
    exprs = " ".join(rule["expr"] for rule in alerts) + " " + " ".join(rules.values())
    for needed in ("ttserve_worker_up", "ttserve_worker_stalled", "ttserve_kv_cache_usage_perc",
                   "ttserve_num_requests_waiting", "ttserve_gateway_control_plane_connected",
                   "ttserve_request_success_total", "up"):
        assert any(needed in deps for deps in used), f"no alert watches {needed}"
    assert 'up{job="ttserve-worker"}' in exprs
    assert 'finished_reason="error"' in exprs
    kv = next(rule for rule in alerts if "ttserve_kv_cache_usage_perc" in rule["expr"])
    assert re.search(r">\s*0\.9\b", kv["expr"]) and kv["for"] == "5m", kv


# ---- Grafana ------------------------------------------------------------------------------------

def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries(board: dict) -> list[tuple[str, str]]:
    """(where, expr) of every query of every panel, rows' nested panels included."""
    out = []

    def walk(panels):
        for panel in panels:
            for target in panel.get("targets", []):
                out.append((f"panel {panel['id']} {panel['title']!r} {target['refId']}", target["expr"]))
            walk(panel.get("panels", []))
    walk(board["panels"])
    return out


def grafana_to_promql(expr: str) -> str:
    """A dashboard query as plain PromQL: Grafana's variables replaced by values they take."""
    expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m").replace("$__range", "1h")
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


def test_dashboard_structure():
    board = dashboard()
    assert board["uid"] and board["title"]
    assert 36 <= board["schemaVersion"] <= 41
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    worker = variables["worker"]
    assert worker["type"] == "query" and worker["includeAll"] and worker["multi"]
    definition = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", worker["definition"])
    assert definition, worker["definition"]
    assert definition.group(1) in CATALOG and definition.group(2) in CATALOG[definition.group(1)].labels
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells = set()
    for panel in board["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not area & cells, f"panel {panel['title']!r} overlaps another"
        cells |= area
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    # Provisioned datasource uid = the variable's default, so the dashboard works on first start.
    provisioned = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert variables["datasource"]["current"]["value"] in {d["uid"] for d in provisioned["datasources"]}


def test_dashboard_queries_use_only_catalog_metrics():
    known = known_series()
    problems = []
    for where, expr in dashboard_queries(dashboard()):
        problems += check_expr(grafana_to_promql(expr), known, where)
    assert not problems, "\n".join(problems)


def test_dashboard_covers_the_serving_signals():
    used = set()
    for _, expr in dashboard_queries(dashboard()):
        used |= promql_refs(grafana_to_promql(expr)).names
    wanted = {
        "ttserve_num_requests_running", "ttserve_num_requests_waiting", "ttserve_kv_cache_usage_perc",
        "ttserve_time_to_first_token_seconds_bucket", "ttserve_inter_token_latency_seconds_bucket",
        "ttserve_request_time_per_output_token_seconds_bucket", "ttserve_e2e_request_latency_seconds_bucket",
        "ttserve_generation_tokens_total", "ttserve_prompt_tokens_total",
        "ttserve_prefix_cache_hits_total", "ttserve_prefix_cache_queries_total",
        "ttserve_num_preemptions_total", "ttserve_step_duration_seconds_bucket", "ttserve_steps_total",
        "ttserve_sampling_batches_total", "ttserve_async_drains_total", "ttserve_step_rtt_seconds_bucket",
        "ttserve_worker_up", "ttserve_worker_ready", "ttserve_worker_stalled",
        "ttserve_worker_warmup_progress", "ttserve_request_success_total",
        "ttserve_gateway_refused_requests_total",
    }
    assert not wanted - used, f"the dashboard shows nothing of {sorted(wanted - used)}"


def test_dashboard_queries_parse(tmp_path):
    """promtool has no query linter; a rule file with one recording rule per dashboard query
    makes `promtool check rules` parse every one of them."""
    promtool = require_tool("promtool")
    rules = [{"record": f"dashboard:query:{i}", "expr": grafana_to_promql(expr)}
             for i, (_, expr) in enumerate(dashboard_queries(dashboard()))]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = run([promtool, "check", "rules", str(path)])
    assert done.returncode == 0, output(done)


def test_grafana_provisioning_matches_compose_mounts():
    compose = yaml.safe_load(COMPOSE.read_text())
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"] if v.startswith("./"))
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "ttserve.yml").read_text())["providers"]
    assert [p["options"]["path"] for p in providers] == [mounts["./grafana/dashboards"]]
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    url = datasources["datasources"][0]["url"]
    assert url == "http://prometheus:9090" and "prometheus" in compose["services"]


# ---- the services' flag parsers, for checking configured command lines -------------------------

def parse_service_args(service: str, argv: list[str]) -> argparse.Namespace:
    """argv parsed by the service's own parser (as `ttserve SERVICE` does); fails on unknown flags."""
    import importlib

    module = importlib.import_module(f"ttserve.{service}.config")
    parser = argparse.ArgumentParser(prog=f"ttserve {service}", exit_on_error=False)
    module.add_arguments(parser)

    def refuse(message):
        raise AssertionError(f"ttserve {service} {shlex.join(argv)}: {message}")
    parser.error = refuse
    parse = getattr(module, "parse_args", None)
    return parse(parser, argv) if parse else parser.parse_args(argv)


def check_worker_settings(args: argparse.Namespace, env: dict[str, str]) -> None:
    from ttserve.worker.planning.mesh import PRESETS, parse_visible_devices
    from ttserve.worker.planning.options import parse_additional_config

    parse_additional_config(args.additional_config, getattr(args, "additional_config_dotted", None))
    mesh = env.get("MESH_DEVICE", "").strip()
    assert not mesh or mesh in PRESETS or re.fullmatch(r"[(\[]\s*\d+\s*,\s*\d+\s*[)\]]", mesh), mesh
    parse_visible_devices(env.get("TT_VISIBLE_DEVICES"))


# ---- systemd --------------------------------------------------------------------------------------

# What every unit's ExecStart= adds before the environment file's flags: its certificate from the
# credentials directory (%d), mutual TLS with the one CA, and the gateway's key file.
_TLS_FLAGS = "--ssl-certfile %d/tls.crt --ssl-keyfile %d/tls.key --ssl-ca-certs %d/ca.crt"
UNIT_SECURITY_FLAGS = {"worker": _TLS_FLAGS, "control": _TLS_FLAGS,
                       "gateway": f"{_TLS_FLAGS} --api-key-file %d/api-key"}
UNITS = {"worker": "ttserve-worker.service", "worker@": "ttserve-worker@.service",
         "control": "ttserve-control.service", "gateway": "ttserve-gateway.service"}
def shutdown_timeout(argv: list[str]) -> float:
    for i, arg in enumerate(argv):
        if arg == "--shutdown-timeout":
            return float(argv[i + 1])
        if arg.startswith("--shutdown-timeout="):
            return float(arg.split("=", 1)[1])
    return DEFAULT_SHUTDOWN_TIMEOUT_S


def example_for(env_path: str) -> Path:
    name = Path(env_path.lstrip("-")).name.replace("-%i", "")
    return SYSTEMD / f"{name}.example"


@pytest.mark.parametrize("key", list(UNITS))
def test_unit_restart_hardening_and_drain(key):
    service = key.rstrip("@")
    unit = read_unit(SYSTEMD / UNITS[key])
    svc = dict(unit["Service"])
    # Restarts, bounded.
    assert one(unit, "Service", "Restart") == "on-failure"
    assert one(unit, "Service", "RestartSec")
    assert one(unit, "Unit", "StartLimitIntervalSec") and one(unit, "Unit", "StartLimitBurst")
    # Hardening.
    for flag in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelTunables", "ProtectKernelModules",
                 "ProtectControlGroups", "RestrictSUIDSGID", "LockPersonality", "RestrictRealtime"):
        assert svc.get(flag) == "yes", f"{UNITS[key]}: {flag}=yes"
    assert svc.get("ProtectSystem") == "strict"
    assert values(unit, "Service", "CapabilityBoundingSet") == [""], "no capabilities at all"
    assert svc.get("StateDirectory") and svc.get("CacheDirectory"), "writable dirs under ProtectSystem=strict"
    assert svc.get("User") and svc["User"] != "root"
    # Configuration from /etc/ttserve, the command line from one variable of it.
    env_files = values(unit, "Service", "EnvironmentFile")
    assert f"/etc/ttserve/{service}{'-%i' if key.endswith('@') else ''}.env" in env_files, env_files
    assert one(unit, "Service", "ExecStart") == f"{INSTALLED_BINARY} {service} {UNIT_SECURITY_FLAGS[service]} " \
                                                f"$TTSERVE_{service.upper()}_ARGS"
    # TLS material (and the gateway's API keys) from /etc/ttserve/tls, through credentials only
    # systemd (root) reads, all required.
    credentials = dict(v.split(":", 1) for v in values(unit, "Service", "LoadCredential"))
    expected = {"tls.crt": f"/etc/ttserve/tls/{service}.crt", "tls.key": f"/etc/ttserve/tls/{service}.key",
                "ca.crt": "/etc/ttserve/tls/ca.crt"}
    if service == "gateway":
        expected["api-key"] = "/etc/ttserve/tls/api-key"
    assert credentials == expected
    # Drain: SIGTERM, and more time before SIGKILL than the service's own --shutdown-timeout.
    assert svc.get("KillSignal") == "SIGTERM"
    env = read_env_file(example_for(f"/etc/ttserve/{service}.env"))
    argv = expand_exec_args(svc["ExecStart"], env)
    assert seconds(svc["TimeoutStopSec"]) > shutdown_timeout(argv) + 5, svc["TimeoutStopSec"]
    # Grouped under ttserve.target.
    assert "ttserve.target" in words(unit, "Unit", "PartOf")
    assert "ttserve.target" in words(unit, "Install", "WantedBy")


def test_worker_unit_keeps_device_access():
    for key in ("worker", "worker@"):
        unit = read_unit(SYSTEMD / UNITS[key])
        assert one(unit, "Service", "PrivateDevices") in (None, "no"), "PrivateDevices hides /dev/tenstorrent"
        assert one(unit, "Service", "DevicePolicy") in (None, "auto"), "closed policies drop /dev/null & co"
        allowed = " ".join(values(unit, "Service", "DeviceAllow"))
        assert re.search(r"(char-tenstorrent|/dev/tenstorrent\S*)\s+rw", allowed), allowed
        writable = words(unit, "Service", "ReadWritePaths")
        assert {"-/dev/hugepages-1G", "-/dev/hugepages"} <= writable, writable
    for key in ("control", "gateway"):
        assert one(read_unit(SYSTEMD / UNITS[key]), "Service", "PrivateDevices") == "yes"


def test_units_order_worker_control_gateway():
    control = read_unit(SYSTEMD / UNITS["control"])
    gateway = read_unit(SYSTEMD / UNITS["gateway"])
    template = read_unit(SYSTEMD / UNITS["worker@"])
    assert {"ttserve-worker.service"} <= words(control, "Unit", "After") & words(control, "Unit", "Wants")
    assert {"ttserve-control.service"} <= words(gateway, "Unit", "After") & words(gateway, "Unit", "Wants")
    assert "ttserve-control.service" in words(template, "Unit", "Before")
    # Wants=, never Requires=/BindsTo=: each service restarts on its own.
    for key in UNITS:
        unit = read_unit(SYSTEMD / UNITS[key])
        assert not values(unit, "Unit", "Requires") and not values(unit, "Unit", "BindsTo"), UNITS[key]
    # Every ttserve unit named anywhere exists.
    present = {p.name for p in SYSTEMD.iterdir()}
    for path in SYSTEMD.glob("ttserve*"):
        for name in re.findall(r"\bttserve[\w@.-]*\.(?:service|target)\b", path.read_text()):
            base = re.sub(r"@[^.]+\.", "@.", name)
            assert name in present or base in present, f"{path.name} names {name}, which deploy/systemd lacks"
    target = read_unit(SYSTEMD / "ttserve.target")
    assert "multi-user.target" in words(target, "Install", "WantedBy")


def test_no_secrets_in_units_or_examples():
    secret = re.compile(r"^[ \t]*(VLLM_API_KEY|[A-Z_]*(PASSWORD|SECRET|TOKEN))[ \t]*=[ \t]*\S", re.M)
    for path in list(SYSTEMD.iterdir()) + list(DOCKER.glob("*.env*")) + [COMPOSE]:
        text = path.read_text()
        assert not secret.search(text), f"{path.name} assigns a secret"
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        # --api-key-file names a file; --api-key KEY would show the key in ps.
        assert not re.search(r"--api-key(?!-file)", code), f"{path.name}: an API key flag would show in ps"
        assert not re.search(r"Environment=.*(KEY|PASSWORD|SECRET)", code), path.name
    gateway = read_unit(SYSTEMD / UNITS["gateway"])
    assert values(gateway, "Service", "EnvironmentFile") == ["/etc/ttserve/gateway.env"]
    assert "api-key:/etc/ttserve/tls/api-key" in values(gateway, "Service", "LoadCredential")


@pytest.mark.parametrize("service", SERVICES)
def test_env_examples_parse_with_the_service_flags(service):
    """The example command lines, after systemd's env-file reading and $VAR splitting, are
    accepted by the service's own argument parser (and the worker's device settings by its
    validators)."""
    unit = read_unit(SYSTEMD / UNITS[service])
    env = read_env_file(SYSTEMD / f"{service}.env.example")
    argv = expand_exec_args(one(unit, "Service", "ExecStart"), env)
    assert argv[:2] == [INSTALLED_BINARY, service]
    assert f"TTSERVE_{service.upper()}_ARGS" in env
    args = parse_service_args(service, argv[2:])
    if service == "worker":
        assert {"MESH_DEVICE", "TT_VISIBLE_DEVICES"} <= set(env)
        assert args.additional_config, "the example shows --additional-config"
        check_worker_settings(args, env)


def test_env_file_reading_keeps_quoted_json_as_one_argument():
    env = parse_env_text("""A=--x 1 --additional-config '{"tt": {"trace_mode": "all"}}'""")
    assert expand_exec_args("/bin/t worker $A", env) == [
        "/bin/t", "worker", "--x", "1", "--additional-config", '{"tt": {"trace_mode": "all"}}']


# systemd-analyze verify: on this kind of host (no systemd as PID 1) it needs two things that a
# real install provides: the ExecStart= binary (it refuses "Command ... is not executable") and
# the system's own units (sysinit.target, basic.target ...; else "Unit sysinit.target not found").
# Rather than rewriting the units, the test builds a throw-away root with --root=: the units
# under /etc/systemd/system, a stand-in executable at the install path, and a copy of the host's
# system units. Unknown keys and unparsable values only produce warnings with exit status 0, so
# any output that names one of the units fails the test too.

SYSTEM_UNIT_DIRS = ("/usr/lib/systemd/system", "/lib/systemd/system")


def systemd_analyze(feature: str) -> str:
    tool = require_tool("systemd-analyze")
    if feature not in run([tool, "--help"]).stdout:
        message = f"systemd-analyze lacks {feature} (systemd 250 or later needed)"
        if REQUIRE_OPS_TOOLS:
            pytest.fail(message)
        pytest.skip(message)
    return tool


def fake_root(tmp_path: Path, units: dict[str, str]) -> Path:
    root = tmp_path / "root"
    unit_dir = root / "etc" / "systemd" / "system"
    unit_dir.mkdir(parents=True)
    for name, text in units.items():
        (unit_dir / name).write_text(text)
    binary = root / INSTALLED_BINARY.lstrip("/")
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    kill = root / "bin" / "kill"  # the control plane's ExecReload= (verify checks it is executable)
    kill.parent.mkdir(parents=True, exist_ok=True)
    kill.write_text("#!/bin/sh\nexit 0\n")
    kill.chmod(0o755)
    host_units = next((Path(d) for d in SYSTEM_UNIT_DIRS if (Path(d) / "sysinit.target").exists()), None)
    assert host_units is not None, f"none of {SYSTEM_UNIT_DIRS} holds the system's units"
    shutil.copytree(host_units, root / "usr" / "lib" / "systemd" / "system", symlinks=True)
    return root


def verify_units(tool: str, root: Path, names: list[str]) -> list[str]:
    """Problems systemd-analyze verify reports for `names` (empty: all clean)."""
    cmd = [tool, "verify", f"--root={root}", "--man=no"]
    if "--recursive-errors" in run([tool, "--help"]).stdout:
        cmd.append("--recursive-errors=no")  # the host's own units are not under test
    done = run(cmd + names, cwd=root)
    mentions = [line for line in (done.stdout + done.stderr).splitlines()
                if any(n.split("@")[0] in line for n in names)]
    problems = mentions[:]
    if done.returncode != 0:
        problems.append(output(done))
    return problems


def our_units() -> dict[str, str]:
    return {p.name: p.read_text() for p in SYSTEMD.glob("ttserve*") if p.suffix in (".service", ".target")}


def verify_names(units: dict[str, str]) -> list[str]:
    return [name.replace("@.", "@0.") for name in sorted(units)]  # a template verifies as an instance


def test_systemd_analyze_verify(tmp_path):
    tool = systemd_analyze("--root")
    units = our_units()
    problems = verify_units(tool, fake_root(tmp_path, units), verify_names(units))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("breakage", [
    ("KillSignal=SIGTERM", "KillSignal=SIGTERMM"),                 # a value systemd cannot parse
    ("ProtectSystem=strict", "ProtectSytem=strict"),               # a misspelt key
    ("[Service]", "[Servce]"),                                     # a misspelt section
    (f"ExecStart={INSTALLED_BINARY}", "ExecStart=ttserve"),        # a relative command
])
def test_systemd_analyze_verify_catches_broken_units(tmp_path, breakage):
    """The check above is only worth something if it fails on real mistakes, including those
    systemd-analyze reports with exit status 0."""
    tool = systemd_analyze("--root")
    units = our_units()
    old, new = breakage
    assert old in units["ttserve-gateway.service"]
    units["ttserve-gateway.service"] = units["ttserve-gateway.service"].replace(old, new, 1)
    problems = verify_units(tool, fake_root(tmp_path, units), ["ttserve-gateway.service"])
    assert problems, f"systemd-analyze verify accepted a unit with {new!r}"


def test_systemd_security_exposure(tmp_path):
    """`systemd-analyze security` scores the sandboxing; a dropped hardening line raises it."""
    tool = systemd_analyze("--offline")
    units = our_units()
    root = fake_root(tmp_path, units)
    for name in verify_names({n: t for n, t in units.items() if n.endswith(".service")}):
        # --threshold is on the 0-100 scale of the printed 0.0-10.0 exposure: at most 4.0 ("OK").
        done = run([tool, "security", "--offline=yes", f"--root={root}", "--threshold=40", name], cwd=root)
        assert done.returncode == 0, output(done)[-2000:]


# ---- Docker ---------------------------------------------------------------------------------------

DOCKER_BASE = {"worker": "python:3.12-slim", "control": "python:3.12-slim", "gateway": "python:3.11-slim"}


@pytest.mark.parametrize("service", SERVICES)
def test_dockerfile(service):
    docker = read_dockerfile(DOCKER / f"Dockerfile.{service}")
    final = docker.final_stage()
    assert final.all("FROM")[0].split()[0] == DOCKER_BASE[service]
    # Non-root.
    users = final.all("USER")
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    # Ports: the service's HTTP port (and gRPC port) exposed, the healthcheck on an exposed port.
    exposed = {int(p.split("/")[0]) for args in final.all("EXPOSE") for p in args.split()}
    assert HTTP_PORT[service] in exposed and (service == "gateway" or GRPC_PORT[service] in exposed), exposed
    healthchecks = final.all("HEALTHCHECK")
    assert len(healthchecks) == 1 and "urllib.request" in healthchecks[0], healthchecks
    env = " ".join(final.all("ENV"))
    url = re.search(r"TTSERVE_HEALTH_URL=(\S+)", env).group(1)
    scheme = "https" if service == "gateway" else "http"  # the gateway's default CMD serves HTTPS
    # Liveness (/health): a /ready healthcheck would mark a warming-up service unhealthy.
    assert re.fullmatch(rf"{scheme}://127\.0\.0\.1:{HTTP_PORT[service]}/health", url), url
    # The default command is one the service accepts, with mutual TLS from /run/secrets.
    args = parse_service_args(service, json.loads(final.all("CMD")[-1]))
    assert args.host == "0.0.0.0" and args.ssl_ca_certs == "/run/secrets/ca.crt" and not args.insecure
    assert args.ssl_certfile == f"/run/secrets/{service}.crt"
    # Exec-form entrypoint, so SIGTERM reaches ttserve and starts the drain.
    entrypoint = json.loads(final.all("ENTRYPOINT")[0])
    assert entrypoint == ["ttserve", service]
    assert final.all("STOPSIGNAL") == ["SIGTERM"]
    # The package with this service's extra.
    runs = " ".join(final.all("RUN"))
    assert f"[{service}]" in runs
    # Every COPY source of the repository exists and is let through the Dockerfile's ignore file.
    ignore = (DOCKER / f"Dockerfile.{service}.dockerignore").read_text().split()
    for args in docker.all("COPY"):
        if args.startswith("--from"):
            continue
        for source in args.split()[:-1]:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
            assert f"!{source}" in ignore, f"{source} is excluded by Dockerfile.{service}.dockerignore"
    build_runs = " ".join(docker.all("RUN"))
    assert "grpcio-tools" in build_runs, "setup.py generates protobuf stubs with grpcio-tools"


def test_worker_dockerfile_installs_ttnn_on_request():
    docker = read_dockerfile(DOCKER / "Dockerfile.worker")
    args = dict(a.partition("=")[::2] for a in docker.all("ARG"))
    assert args.get("INSTALL_TTNN") == "false" and args.get("TTNN_VERSION") == "0.81.1", args
    assert 'ttnn==${TTNN_VERSION}' in " ".join(docker.all("RUN"))


def test_gateway_dockerfile_pins_cpu_torch_and_removes_its_companions():
    docker = read_dockerfile(DOCKER / "Dockerfile.gateway")
    args = dict(a.partition("=")[::2] for a in docker.all("ARG"))
    assert args.get("TORCH_VERSION") == "2.13.0"
    assert args.get("TORCH_INDEX") == "https://download.pytorch.org/whl/cpu"
    runs = " ".join(docker.all("RUN"))
    assert re.search(r"pip uninstall -y torchvision torchaudio torchcodec", runs)
    assert '"torch==${TORCH_VERSION}"' in runs


# ---- certificates ---------------------------------------------------------------------------------

def test_make_certs_makes_a_ca_and_a_certificate_per_service_that_the_services_load(tmp_path):
    from cryptography import x509

    from ttserve.tls import load_tls

    require_tool("openssl")
    done = run(["bash", str(DEPLOY / "make-certs.sh"), str(tmp_path), "worker=10.0.0.5,worker.example",
                "control", "gateway"])
    assert done.returncode == 0, output(done)
    assert len((tmp_path / "api-key").read_text().strip()) == 64
    for name in SERVICES:
        files = [str(tmp_path / f) for f in (f"{name}.crt", f"{name}.key", "ca.crt")]
        assert load_tls(*files).mutual  # a certificate, its key, the CA
        assert run(["openssl", "verify", "-CAfile", files[2], files[0]]).returncode == 0
        assert (tmp_path / f"{name}.key").stat().st_mode & 0o077 == 0, "keys are private"
        cert = x509.load_pem_x509_certificate((tmp_path / f"{name}.crt").read_bytes())
        assert cert.subject.rfc4514_string() == f"CN={name}"  # the worker's --control-identity names it
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert {name, "localhost"} <= set(sans.get_values_for_type(x509.DNSName))
        assert "127.0.0.1" in {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    worker = x509.load_pem_x509_certificate((tmp_path / "worker.crt").read_bytes())
    sans = worker.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "worker.example" in sans.get_values_for_type(x509.DNSName)
    assert "10.0.0.5" in {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    # Run again for one more service: the CA (and so every certificate made before) is kept.
    ca = (tmp_path / "ca.crt").read_bytes()
    assert run(["bash", str(DEPLOY / "make-certs.sh"), str(tmp_path), "worker-1"]).returncode == 0
    assert (tmp_path / "ca.crt").read_bytes() == ca and (tmp_path / "worker-1.crt").is_file()


# ---- docker-compose -------------------------------------------------------------------------------

COMPOSE_ENV = {"GRAFANA_ADMIN_PASSWORD": "test-only", "TTSERVE_MODELS_DIR": "/srv/models",
               "TTSERVE_MODEL": "SmolLM2-135M-Instruct", "TTSERVE_TLS_DIR": "/srv/ttserve-tls"}


def compose_env(**overrides) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in COMPOSE_ENV and k != "VLLM_API_KEY"}
    env.update(COMPOSE_ENV)
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


def test_docker_compose_config_validates():
    tool = require_tool("docker-compose")
    done = run([tool, "-f", str(COMPOSE), "config", "-q"], env=compose_env(), cwd=ROOT)
    assert done.returncode == 0, output(done)


def test_docker_compose_requires_the_grafana_password():
    """No default password is committed: without the variable compose refuses the file."""
    tool = require_tool("docker-compose")
    done = run([tool, "-f", str(COMPOSE), "config", "-q"], env=compose_env(GRAFANA_ADMIN_PASSWORD=None), cwd=ROOT)
    assert done.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in done.stderr, output(done)


def compose_command(command: list[str]) -> list[str]:
    """A compose `command:` with ${VAR}, ${VAR:-default} and ${VAR:?message} substituted (a
    required variable the test does not set raises ComposeError)."""
    return [interpolate(arg, COMPOSE_ENV) for arg in command]


def test_docker_compose_services():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) == {"worker", "control", "gateway", "prometheus", "grafana"}
    # Liveness everywhere. A /ready healthcheck deadlocks the start: the worker is ready only after
    # the control plane's Warmup, and the control plane starts only once the worker is healthy.
    health_url = {"worker": "http://127.0.0.1:9402/health", "control": "http://127.0.0.1:9401/health",
                  "gateway": "https://127.0.0.1:8000/health"}
    depends = {"control": "worker", "gateway": "control"}
    for name in SERVICES:
        service = services[name]
        test = " ".join(service["healthcheck"]["test"])
        assert health_url[name] in test and str(HTTP_PORT[name]) in health_url[name], test
        assert "/ready" not in test, f"{name}: readiness is not liveness"
        assert duration(service["stop_grace_period"]) > DEFAULT_SHUTDOWN_TIMEOUT_S + 5
        assert service["build"]["dockerfile"] == f"deploy/docker/Dockerfile.{name}"
        assert (DEPLOY / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
        for env_file in service["env_file"]:
            assert (DEPLOY / env_file).is_file(), env_file
        models = [v for v in service["volumes"] if ":/models" in v]
        assert models and all(v.endswith(":ro") for v in models), service["volumes"]
        if name in depends:
            assert service["depends_on"] == {depends[name]: {"condition": "service_healthy"}}
        # The command line is one the service accepts.
        args = parse_service_args(name, compose_command(service["command"]))
        assert args.host == "0.0.0.0", f"{name} must listen beyond the container's loopback"
        if name == "worker":
            check_worker_settings(args, {})
        # Mutual TLS with the service's own certificate, every file a secret it mounts.
        assert (args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs) == (
            f"/run/secrets/{name}.crt", f"/run/secrets/{name}.key", "/run/secrets/ca.crt")
        assert not args.insecure and "environment" not in service
        mounted = {f"/run/secrets/{secret}" for secret in service["secrets"]}
        assert {args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs} <= mounted
        assert not any(s.endswith(".key") and s != f"{name}.key" for s in service["secrets"]), "only its own key"
    assert parse_service_args("worker", compose_command(services["worker"]["command"])).control_identity == "control"
    gateway_args = parse_service_args("gateway", compose_command(services["gateway"]["command"]))
    assert gateway_args.api_key_file == "/run/secrets/api-key" and "api-key" in services["gateway"]["secrets"]
    assert not gateway_args.public_metrics and {"ca.crt", "api-key"} <= set(services["prometheus"]["secrets"])
    for secret in compose["secrets"].values():
        assert secret["file"].startswith("${TTSERVE_TLS_DIR:?"), secret
    control_args = parse_service_args("control", compose_command(services["control"]["command"]))
    # Named as prometheus.yml labels the worker's own target, so the two views join.
    assert control_args.worker == [f"0=worker:{GRPC_PORT['worker']}"]
    assert gateway_args.control == (f"control:{GRPC_PORT['control']}",)
    # Prometheus reads deploy/prometheus; its rule files sit beside the config.
    assert "./prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    # Grafana's password only ever comes from the environment, and is required.
    password = services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]*\}", password), password
    # Tenstorrent device access is there, commented out, for the worker.
    text = COMPOSE.read_text()
    assert re.search(r"^\s*#\s*-\s*/dev/tenstorrent:/dev/tenstorrent", text, re.M)
    assert re.search(r"^\s*#\s*-\s*/dev/hugepages-1G:/dev/hugepages-1G", text, re.M)
