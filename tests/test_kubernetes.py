"""Checks of the Kubernetes manifests under deploy/kubernetes/: fast, no cluster.

Every kustomization renders with `kubectl kustomize` (the test skips without kubectl, or fails
under TTSERVE_REQUIRE_OPS_TOOLS=1, as in CI) and its objects validate offline, strictly (no
unknown field), against the API schemas of KUBERNETES_VERSION. The rendered objects are then
checked against what the services declare: each container's args are parsed by the service's
own flag parser (an unknown flag fails), and its ports, probes, mounted files, Services and
NetworkPolicies are compared with the parsed flags and with the paths the code serves.

The PodMonitor (monitoring/) is a custom resource, for which kubernetes-validate has no schema:
it is checked against PODMONITOR_SUBSET, written here from the Prometheus Operator's CRD, and
against the pods it scrapes.
"""
from __future__ import annotations

import argparse
import functools
import json
import re
import types
from dataclasses import dataclass
from pathlib import Path

import jsonschema  # comes with kubernetes-validate
import kubernetes_validate
import pytest
import yaml

from stack import require_tool
from test_deploy import (DEPLOY, DOCKER, PROMETHEUS_JOB, SERVICES, check_worker_settings, output,
                         parse_service_args, run)
from ttserve.gateway.api_keys import OPEN_PATHS

KUBERNETES = DEPLOY / "kubernetes"
# The Kubernetes version the manifests are validated for. Every field they use is GA since 1.22
# (the newest: the kubernetes.io/metadata.name namespace label the NetworkPolicies select on).
KUBERNETES_VERSION = "1.32"
OVERLAYS = ("overlays/cpu", "overlays/tenstorrent")
DEPLOYMENTS = ("base", *OVERLAYS)
MONITORING = "monitoring"
# Where NetworkPolicies admit Prometheus (base/network-policies.yaml documents these labels).
PROMETHEUS_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                   "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
PROBES = {"startupProbe": "/health", "livenessProbe": "/health", "readinessProbe": "/ready"}


@functools.cache
def _rendered(folder: str) -> str:
    done = run([require_tool("kubectl"), "kustomize", str(KUBERNETES / folder)])
    assert done.returncode == 0, output(done)
    return done.stdout


def render(folder: str) -> list[dict]:
    """The objects `kubectl kustomize` makes of the folder (a fresh copy each call)."""
    return [doc for doc in yaml.safe_load_all(_rendered(folder)) if doc]


def selects(selector: dict, labels: dict) -> bool:
    """A matchLabels selector (the only kind these manifests use) against a label set."""
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


@dataclass
class Workload:
    """One service's StatefulSet or Deployment, with its container's args parsed."""
    service: str
    doc: dict
    container: dict
    args: argparse.Namespace

    @property
    def pod(self) -> dict:
        return self.doc["spec"]["template"]["spec"]

    @property
    def labels(self) -> dict:
        return self.doc["spec"]["template"]["metadata"]["labels"]

    @property
    def ports(self) -> dict[str, int]:
        return {p["name"]: p["containerPort"] for p in self.container.get("ports", [])}

    @property
    def ops_port(self) -> int:
        """Where /health, /ready and /metrics are served: the metrics port, or the gateway's own."""
        return self.args.port if self.service == "gateway" else self.args.metrics_port

    def port_number(self, port: int | str) -> int:
        """A port given by number or by name, as a declared container port."""
        number = self.ports.get(port) if isinstance(port, str) else port
        assert number in self.ports.values(), f"{self.service}: port {port!r} is not a declared container port"
        return number

    def volume(self, name: str) -> dict:
        """A pod volume, or a StatefulSet's claim template as {"name", "volumeClaimTemplate"}."""
        templates = [{"name": t["metadata"]["name"], "volumeClaimTemplate": t}
                     for t in self.doc["spec"].get("volumeClaimTemplates", [])]
        [volume] = [v for v in self.pod.get("volumes", []) + templates if v["name"] == name]
        return volume

    def mounts(self, container: dict | None = None) -> dict[str, str]:
        """mountPath -> volume name, of the service's container or another of the pod."""
        return {m["mountPath"]: m["name"] for m in (container or self.container).get("volumeMounts", [])}

    def secret_files(self) -> dict[str, tuple[str, str]]:
        """Every file the pod's projected Secret volumes put in the container: path -> (Secret, key)."""
        files = {}
        for path, name in self.mounts().items():
            for source in self.volume(name).get("projected", {}).get("sources", []):
                for item in source["secret"]["items"]:
                    files[f"{path}/{item['path']}"] = (source["secret"]["name"], item["key"])
        return files


def workloads(docs: list[dict]) -> dict[str, Workload]:
    found = {}
    for doc in docs:
        if doc["kind"] not in ("StatefulSet", "Deployment"):
            continue
        containers = doc["spec"]["template"]["spec"]["containers"]
        assert len(containers) == 1, f"{doc['metadata']['name']}: one container per pod"
        container = containers[0]
        service = container["name"]
        assert service in SERVICES and service not in found, service
        # The image's ENTRYPOINT is `ttserve SERVICE` (deploy/docker/Dockerfile.SERVICE): args only.
        assert "command" not in container, f"{service}: `command` would replace the image's ENTRYPOINT"
        assert re.fullmatch(rf"ttserve-{service}(:[\w.-]+)?", container["image"]), container["image"]
        found[service] = Workload(service, doc, container, parse_service_args(service, container["args"]))
    assert set(found) == set(SERVICES), sorted(found)
    return found


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def serves(service: str, path: str) -> bool:
    """Whether the service answers GET `path` (on its ops port: the gateway's own port)."""
    if service == "gateway":
        from ttserve.gateway import metrics, readiness

        app = types.SimpleNamespace(router=types.SimpleNamespace(routes=[]))
        readiness.install(app, probe=None)
        metrics.install(app)
        # /health is vLLM's own route (over GatewayLLM.check_health), the one the key leaves open.
        return path in {route.path for route in app.router.routes} | OPEN_PATHS
    from prometheus_client import CollectorRegistry

    from ttserve.ops_http import OpsEndpoints, _respond

    endpoints = OpsEndpoints(CollectorRegistry(), health=lambda: (True, ""), ready=lambda: (True, ""))
    return not _respond(f"GET {path} HTTP/1.1\r\n\r\n".encode(), endpoints)[0].startswith("404")


def probe_target(w: Workload, probe: dict) -> tuple[str, int, str]:
    """(path, port, scheme) that a probe asks: an httpGet, or the URL an exec probe opens."""
    if "httpGet" in probe:
        get = probe["httpGet"]
        return get["path"], w.port_number(get["port"]), get.get("scheme", "HTTP")
    urls = re.findall(r"(https?)://127\.0\.0\.1:(\d+)(/[\w/]*)", " ".join(probe["exec"]["command"]))
    assert len(urls) == 1, probe
    scheme, port, path = urls[0]
    return path, w.port_number(int(port)), scheme.upper()


# ---- rendering and schema validation ------------------------------------------------------------

@pytest.mark.parametrize("folder", DEPLOYMENTS)
def test_renders_and_validates_strictly(folder):
    docs = render(folder)
    errors = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as e:
            errors.append(f"{doc['kind']} {doc['metadata']['name']}: {e.message}")
    assert not errors, "\n".join(errors)
    assert {doc["metadata"].get("namespace") for doc in docs} == {"ttserve"}
    # Keys come from Secrets the operator creates (deploy/README.md), never from these files.
    assert not of_kind(docs, "Secret")


def test_no_key_material_in_the_manifests():
    for path in KUBERNETES.rglob("*"):
        if path.is_file():
            assert "PRIVATE KEY" not in path.read_text(), path


# ---- the services' flags against ports, probes, files ---------------------------------------------

@pytest.mark.parametrize("folder", DEPLOYMENTS)
def test_ports_and_probes_match_the_service_flags(folder):
    for w in workloads(render(folder)).values():
        expected = ({"api": w.args.port} if w.service == "gateway" else
                    {"grpc": w.args.port, "metrics": w.args.metrics_port})
        assert w.ports == expected, (w.service, w.ports)
        scheme = "HTTPS" if w.service == "gateway" and w.args.ssl_certfile else "HTTP"
        for kind, path in PROBES.items():
            assert kind in w.container, f"{w.service}: no {kind}"
            target = probe_target(w, w.container[kind])
            assert target == (path, w.ops_port, scheme), (w.service, kind, target)
            assert serves(w.service, path), (w.service, path)
            if w.service == "gateway" and "httpGet" in w.container[kind]:
                # The kubelet sends no API key: an httpGet probe may only ask an open route.
                assert path in OPEN_PATHS, (kind, path)
        # The drain on SIGTERM gets its whole --shutdown-timeout before the kubelet kills.
        assert w.pod["terminationGracePeriodSeconds"] > w.args.shutdown_timeout, w.service


@pytest.mark.parametrize("folder", DEPLOYMENTS)
def test_gateway_readiness_asks_with_the_key_and_the_ca(folder):
    gateway = workloads(render(folder))["gateway"]
    command = " ".join(gateway.container["readinessProbe"]["exec"]["command"])
    assert gateway.args.api_key_file in command and gateway.args.ssl_ca_certs in command, command


@pytest.mark.parametrize("folder", DEPLOYMENTS)
def test_worker_startup_budget_covers_the_warmup_timeout(folder):
    ws = workloads(render(folder))
    startup = ws["worker"].container["startupProbe"]
    budget = startup["failureThreshold"] * startup["periodSeconds"]
    assert budget >= ws["control"].args.warmup_timeout, (budget, ws["control"].args.warmup_timeout)


@pytest.mark.parametrize("folder", DEPLOYMENTS)
def test_every_file_flag_names_a_mounted_file(folder):
    docs = render(folder)
    ws = workloads(docs)
    config_maps = {doc["metadata"]["name"]: doc for doc in of_kind(docs, "ConfigMap")}
    for w in ws.values():
        # Mutual TLS on both gRPC hops, HTTPS and the key at the gateway.
        assert w.args.ssl_certfile and w.args.ssl_keyfile and w.args.ssl_ca_certs, w.service
        provided = set(w.secret_files())
        for mount in w.container["volumeMounts"]:
            config_map = w.volume(mount["name"]).get("configMap")
            if config_map:
                # The kubelet updates a ConfigMap volume in place only where no subPath is used.
                assert "subPath" not in mount, mount
                provided |= {f"{mount['mountPath']}/{key}" for key in config_maps[config_map["name"]]["data"]}
        flags = [w.args.ssl_certfile, w.args.ssl_keyfile, w.args.ssl_ca_certs,
                 getattr(w.args, "api_key_file", None), getattr(w.args, "workers_file", None)]
        for path in filter(None, flags):
            assert path in provided, f"{w.service}: {path} is not a mounted file ({sorted(provided)})"
    assert ws["worker"].args.control_identity == "control"
    assert ws["gateway"].args.api_key_file


@pytest.mark.parametrize("folder", DEPLOYMENTS)
def test_the_readme_creates_every_secret_the_pods_mount(folder):
    section = (DEPLOY / "README.md").read_text().split("## Kubernetes", 1)[1]
    for w in workloads(render(folder)).values():
        for secret, key in set(w.secret_files().values()):
            created = re.search(rf"create secret (tls|generic) {re.escape(secret)} (.*)", section)
            assert created, f"deploy/README.md does not create the Secret {secret}"
            # `create secret tls` stores tls.crt and tls.key; generic ones name their key.
            assert (key in ("tls.crt", "tls.key") if created.group(1) == "tls"
                    else f"--from-file={key}=" in created.group(2)), (secret, key, created.group(0))


# ---- Services, the workers file, who dials whom ---------------------------------------------------

@pytest.mark.parametrize("folder", DEPLOYMENTS)
def test_services_route_to_the_declared_ports(folder):
    docs = render(folder)
    ws = workloads(docs)
    services = {doc["metadata"]["name"]: doc for doc in of_kind(docs, "Service")}
    for name, service in services.items():
        matched = [w for w in ws.values() if selects({"matchLabels": service["spec"]["selector"]}, w.labels)]
        assert len(matched) == 1, (name, [w.service for w in matched])
        for port in service["spec"]["ports"]:
            # The same numbers as on a host: clients and dashboards address one port per role.
            assert matched[0].port_number(port["targetPort"]) == port["port"], (name, port)
    worker = ws["worker"]
    headless = services[worker.doc["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    # The control plane warms a worker up over its DNS name before the worker is ready.
    assert headless["spec"]["publishNotReadyAddresses"] is True
    # The gateway dials the control plane's Service, on the control plane's --port.
    (target,) = ws["gateway"].args.control  # one control plane
    host, _, port = target.rpartition(":")
    control = services[host]
    assert selects({"matchLabels": control["spec"]["selector"]}, ws["control"].labels)
    assert int(port) == ws["control"].args.port in [p["port"] for p in control["spec"]["ports"]]


def listed_workers(docs: list[dict], control: Workload, tmp_path: Path) -> list:
    """The workers the control plane's --workers-file lists, read by the control plane's parser
    from the ConfigMap mounted there."""
    from ttserve.control.worker_set import parse_file

    directory, _, key = control.args.workers_file.rpartition("/")
    config_map = control.volume(control.mounts()[directory])["configMap"]["name"]
    text = next(doc for doc in of_kind(docs, "ConfigMap") if doc["metadata"]["name"] == config_map)["data"][key]
    (tmp_path / key).write_text(text)
    return parse_file(tmp_path / key)


@pytest.mark.parametrize("folder", DEPLOYMENTS)
def test_workers_file_lists_every_statefulset_pod_by_name(folder, tmp_path):
    from ttserve.control.worker_set import WorkerSpec

    docs = render(folder)
    ws = workloads(docs)
    control, worker = ws["control"], ws["worker"]
    assert control.args.worker is None, "the workers come from --workers-file only"
    name, service = worker.doc["metadata"]["name"], worker.doc["spec"]["serviceName"]
    pods = [f"{name}-{i}" for i in range(worker.doc["spec"]["replicas"])]
    assert listed_workers(docs, control, tmp_path) == [WorkerSpec(pod, f"{pod}.{service}:{worker.args.port}")
                                                      for pod in pods]
    # One control plane: a worker refuses a second one's step stream, so never two during an update.
    assert control.doc["spec"]["replicas"] == 1 and control.doc["spec"]["strategy"]["type"] == "Recreate"


def peers(rule: dict, ws: dict[str, Workload]) -> list[str | dict]:
    """Who an ingress rule admits: the services its pod selectors pick, other peers as given,
    ["anyone"] for a rule without `from`."""
    if "from" not in rule:
        return ["anyone"]
    admitted = []
    for peer in rule["from"]:
        if set(peer) == {"podSelector"}:
            admitted += [w.service for w in ws.values() if selects(peer["podSelector"], w.labels)]
        else:
            admitted.append(peer)
    return admitted


@pytest.mark.parametrize("folder", DEPLOYMENTS)
def test_network_policies_admit_only_the_callers(folder):
    docs = render(folder)
    ws = workloads(docs)
    callers = {"worker": ["control"], "control": ["gateway"]}
    policed = set()
    for policy in of_kind(docs, "NetworkPolicy"):
        spec = policy["spec"]
        [target] = [w for w in ws.values() if selects(spec["podSelector"], w.labels)]
        assert spec["policyTypes"] == ["Ingress"] and target.service not in policed
        policed.add(target.service)
        admitted = {}
        for rule in spec["ingress"]:
            for port in rule["ports"]:
                admitted[target.port_number(port["port"])] = peers(rule, ws)
        # Every port the service listens on is open to someone, and no other port.
        assert sorted(admitted) == sorted(target.ports.values()), (target.service, admitted)
        if target.service == "gateway":
            assert admitted[target.args.port] == ["anyone"], "the API: from anywhere"
        else:
            assert admitted[target.args.port] == callers[target.service], (target.service, admitted)
            assert admitted[target.args.metrics_port] == [PROMETHEUS_PEER], (target.service, admitted)
    assert policed == set(SERVICES)


# ---- the overlays: model, hardware ----------------------------------------------------------------

def device_resources(w: Workload) -> dict[str, object]:
    resources = w.container.get("resources", {})
    return {k: v for part in ("requests", "limits") for k, v in resources.get(part, {}).items()
            if k.startswith("tenstorrent.com/")}


def test_tenstorrent_overlay_requests_a_board_with_hugepages():
    worker = workloads(render("overlays/tenstorrent"))["worker"]
    resources = worker.container["resources"]
    boards = device_resources(worker)
    assert boards and all(int(count) >= 1 for count in boards.values()), resources
    for name in [*boards, "hugepages-1Gi"]:
        # Never overcommitted: Kubernetes refuses a request that differs from the limit.
        assert resources["requests"][name] == resources["limits"][name], name
    env = {e["name"]: e["value"] for e in worker.container["env"]}
    assert worker.args.backend == "ttnn" and env.get("MESH_DEVICE"), (worker.args.backend, env)
    check_worker_settings(worker.args, env)
    hugepages = worker.mounts()["/dev/hugepages-1G"]
    assert worker.volume(hugepages)["emptyDir"]["medium"] == "HugePages-1Gi"
    assert worker.container["image"].endswith(":ttnn")


@pytest.mark.parametrize("folder", ("base", "overlays/cpu"))
def test_cpu_deployments_request_no_board(folder):
    assert "tenstorrent.com/" not in json.dumps(render(folder))


def test_cpu_overlay_runs_torch_on_as_many_threads_as_its_cpu_limit():
    worker = workloads(render("overlays/cpu"))["worker"]
    assert worker.args.backend == "torch"
    assert worker.args.num_threads == int(worker.container["resources"]["limits"]["cpu"])


def image_env(dockerfile: Path, name: str) -> str:
    match = re.search(rf"\b{name}=(\S+)", dockerfile.read_text())
    assert match, f"{dockerfile}: no ENV {name}"
    return match.group(1)


@pytest.mark.parametrize("folder", OVERLAYS)
def test_control_plane_and_gateway_see_the_model_folder_the_worker_reports(folder):
    """The worker reports the folder it serves; the control plane reads its tokenizer there and
    the gateway its config.json and tokenizer, at the same path."""
    from ttserve.worker.planning.model_prepare import EMBEDDED_MODELS

    ws = workloads(render(folder))
    worker = ws["worker"]
    cache = image_env(DOCKER / "Dockerfile.worker", "TTSERVE_CACHE_DIR")
    embedded = EMBEDDED_MODELS.get(worker.args.model)
    folder_path = f"{cache}/models/{embedded.folder}" if embedded else worker.args.model
    for w in (ws["control"], ws["gateway"]):
        [mount] = [path for path in w.mounts() if folder_path.startswith(path + "/")]
        volume = w.volume(w.mounts()[mount])
        if embedded:
            # Prepared in the pod by the worker's image, into the volume the container reads.
            [init] = w.pod["initContainers"]
            assert init["command"] == ["ttserve", "model", "prepare", worker.args.model]
            assert init["image"] == worker.container["image"] and w.mounts(init)[mount] == volume["name"]
        else:
            # The worker's own volume, at the same place.
            theirs = worker.volume(worker.mounts()[mount])
            assert volume["persistentVolumeClaim"]["claimName"] == theirs["persistentVolumeClaim"]["claimName"]
    if embedded:
        # The worker converts into its cache volume, the image's TTSERVE_CACHE_DIR.
        assert "volumeClaimTemplate" in worker.volume(worker.mounts()[cache])


# ---- the PodMonitor ------------------------------------------------------------------------------

def _closed(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_STRING = {"type": "string"}
_SECRET_KEY = _closed({"name": _STRING, "key": _STRING, "optional": {"type": "boolean"}}, ("key",))
_SELECTOR = _closed({"matchLabels": {"type": "object", "additionalProperties": _STRING}})
_RELABEL = _closed({"sourceLabels": {"type": "array", "items": _STRING}, "regex": _STRING,
                    "targetLabel": _STRING, "replacement": _STRING})
# The fields of monitoring.coreos.com/v1 PodMonitor that these manifests use, typed as in the
# Prometheus Operator's CRD (example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml,
# operator 0.91.0: spec and spec.selector required, scheme http or https). Closed objects: a
# misspelled field fails here, where the API server would drop it without a word; a field the
# manifests start using is added here, from the CRD.
PODMONITOR_SUBSET = _closed({
    "apiVersion": {"const": "monitoring.coreos.com/v1"},
    "kind": {"const": "PodMonitor"},
    "metadata": _closed({"name": _STRING, "namespace": _STRING,
                         "labels": {"type": "object", "additionalProperties": _STRING}}, ("name",)),
    "spec": _closed({
        "jobLabel": _STRING,
        "selector": _SELECTOR,
        "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _closed({
            "port": _STRING, "path": _STRING, "scheme": {"enum": ["http", "https"]},
            "relabelings": {"type": "array", "items": _RELABEL},
            "tlsConfig": _closed({"ca": _closed({"secret": _SECRET_KEY}), "serverName": _STRING}),
            "authorization": _closed({"type": {"const": "Bearer"}, "credentials": _SECRET_KEY}),
        })},
    }, ("selector",)),
}, ("apiVersion", "kind", "metadata", "spec"))


def test_podmonitor_has_the_crd_shape():
    [monitor] = render(MONITORING)
    jsonschema.validate(monitor, PODMONITOR_SUBSET)
    assert monitor["metadata"]["namespace"] == "ttserve"


def test_podmonitor_subset_refuses_a_misspelled_field():
    [monitor] = render(MONITORING)
    monitor["spec"]["podMetricsEndpoints"][0]["paht"] = "/metrics"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, PODMONITOR_SUBSET)


def relabeled(rule: dict, labels: dict[str, str]) -> str | None:
    """A `replace` relabeling applied to a target's labels: the target label's new value, or None
    where the regex does not match (and the label is left alone)."""
    value = rule.get("separator", ";").join(labels.get(name, "") for name in rule["sourceLabels"])
    match = re.fullmatch(rule["regex"], value)
    return match.expand(rule.get("replacement", "$1").replace("$", "\\")) if match else None


@pytest.mark.parametrize("folder", OVERLAYS)
def test_podmonitor_scrapes_every_service_as_it_serves_metrics(folder, tmp_path):
    [monitor] = render(MONITORING)
    spec = monitor["spec"]
    docs = render(folder)
    ws = workloads(docs)
    worker_names = [entry.name for entry in listed_workers(docs, ws["control"], tmp_path)]
    scraped = set()
    for endpoint in spec["podMetricsEndpoints"]:
        targets = [w for w in ws.values() if selects(spec["selector"], w.labels) and endpoint["port"] in w.ports]
        assert targets, endpoint
        for w in targets:
            scraped.add(w.service)
            assert w.ports[endpoint["port"]] == w.ops_port and serves(w.service, endpoint["path"])
            # The job names deploy/prometheus (alerts, rules) select on.
            assert w.labels[spec["jobLabel"]] == PROMETHEUS_JOB[w.service]
            tls = endpoint.get("tlsConfig")
            assert endpoint.get("scheme", "http") == ("https" if w.service == "gateway" else "http")
            if tls:
                files = w.secret_files()
                # The CA and the key the pod itself is given; make-certs.sh names the certificate
                # after the service.
                ca = tls["ca"]["secret"]
                assert files[w.args.ssl_ca_certs] == (ca["name"], ca["key"]) and tls["serverName"] == w.service
                key = endpoint["authorization"]["credentials"]
                assert files[w.args.api_key_file] == (key["name"], key["key"])
            for rule in endpoint.get("relabelings", []):
                if rule["targetLabel"] != "worker":
                    continue
                pod = f"{w.doc['metadata']['name']}-0"
                meta = {"__meta_kubernetes_pod_name": pod,
                        **{"__meta_kubernetes_pod_label_" + re.sub(r"\W", "_", k): v for k, v in w.labels.items()}}
                if w.service == "worker":
                    # The name the control plane's workers file gives this pod.
                    assert relabeled(rule, meta) == pod == worker_names[0]
                else:
                    # The control plane's own `worker` labels must stay as they are.
                    assert relabeled(rule, meta) is None, w.service
    assert scraped == set(SERVICES)
