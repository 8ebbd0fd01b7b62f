"""deploy/k8s, rendered per overlay as `kubectl apply -k` would (tests/k8s_render.py, no
kustomize binary) and validated offline; no Kubernetes cluster runs here.

Every core object is checked against the Kubernetes OpenAPI schemas bundled with
kubernetes-validate, strict (an unknown or misspelt field fails), for 1.31 and the newest
bundled version. The PodMonitor (a CRD: no bundled schema) is checked by hand. Then the
references a schema cannot see: Service and PodMonitor selectors against the pods' labels,
named ports of Services, probes and PodMonitors against the containers' ports, the Secret
behind every volume and the key file it carries, the HPAs' targets and metric against the
gateway's export, the env against the ports and Services it names and against pdserve's own
settings (built into its config classes, so a bad value fails too), and GPUs only in the
GPU overlay.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version
from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.config import EngineConfig, GatewayConfig, NodeConfig
from pdserve.common.flags import from_args
from pdserve.common.wire.security import ClusterKey
from pdserve.gateway.cluster import ClusterView
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.table import RequestTable
from tests.k8s_render import KINDS, Unsupported, merge, render

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
VERSIONS = ("1.31.0", latest_version())
ROLES = ("gateway", "prefill", "decode")
DOWNWARD = {"status.podIP": "10.1.2.3", "metadata.name": "pdserve-decode-5d9c-x2x7q"}
Obj = dict[str, Any]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deploy/k8s with a fresh cluster key where the base's secretGenerator reads it."""
    copied = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, copied, ignore=shutil.ignore_patterns("cluster.key"))
    ClusterKey.generate().save(copied / "base" / "cluster.key")
    return copied


@pytest.fixture(scope="module")
def overlays(tree: Path) -> dict[str, list[Obj]]:
    return {name: render(tree / "overlays" / name) for name in ("cpu", "gpu")}


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def objs(request: pytest.FixtureRequest, overlays: dict[str, list[Obj]]) -> list[Obj]:
    return overlays[request.param]


def of_kind(objs: list[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def pod(objs: list[Obj], role: str) -> Obj:
    return of_kind(objs, "Deployment")[f"pdserve-{role}"]["spec"]["template"]


def container(objs: list[Obj], role: str) -> Obj:
    [c] = pod(objs, role)["spec"]["containers"]
    return c


def env(c: Obj) -> dict[str, str]:
    """Literal values, downward-API fields as a pod would see them."""
    return {
        e["name"]: e["value"] if "value" in e else DOWNWARD[e["valueFrom"]["fieldRef"]["fieldPath"]]
        for e in c["env"]
    }


def ports(c: Obj) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions) against a pod's labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        present, value = e["key"] in labels, labels.get(e["key"])
        ok = {
            "In": present and value in e["values"],
            "NotIn": value not in e["values"],
            "Exists": present,
            "DoesNotExist": not present,
        }[e["operator"]]
        if not ok:
            return False
    return True


def selected_pods(objs: list[Obj], selector: Obj) -> list[Obj]:
    """The pod templates a LabelSelector picks (a Service's map: wrap it as matchLabels)."""
    pods = [d["spec"]["template"] for d in of_kind(objs, "Deployment").values()]
    return [p for p in pods if selects(selector, p["metadata"]["labels"])]


def test_every_core_object_passes_the_strict_schemas(objs):
    assert {o["kind"] for o in objs} == KINDS
    for obj in objs:
        if obj["kind"] == "PodMonitor":
            continue
        assert obj["metadata"]["name"].startswith("pdserve")
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "pdserve"
        for version in VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda c: c.update(readynessProbe=c.pop("readinessProbe")),  # misspelt field
        lambda c: c["ports"][0].update(containerPort="9100"),  # wrong type
        lambda c: c.pop("name"),  # required field
    ],
)
def test_the_schema_check_fails_on_a_broken_manifest(overlays, mutate):
    deployment = copy.deepcopy(of_kind(overlays["gpu"], "Deployment")["pdserve-decode"])
    mutate(deployment["spec"]["template"]["spec"]["containers"][0])
    for version in VERSIONS:
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(deployment, version, strict=True)


def test_podmonitors_scrape_every_pool_on_a_named_port(objs):
    monitors = of_kind(objs, "PodMonitor")
    scraped = set()
    for monitor in monitors.values():
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
        assert set(monitor["metadata"]) == {"name", "namespace", "labels"}
        assert set(monitor["spec"]) == {"jobLabel", "selector", "podMetricsEndpoints"}
        assert set(monitor["spec"]["selector"]) <= {"matchLabels", "matchExpressions"}
        pods = selected_pods(objs, monitor["spec"]["selector"])
        assert pods, f"{monitor['metadata']['name']} selects no pod"
        for p in pods:
            assert monitor["spec"]["jobLabel"] in p["metadata"]["labels"]
            scraped.add(p["metadata"]["labels"]["app.kubernetes.io/component"])
            [c] = p["spec"]["containers"]
            for endpoint in monitor["spec"]["podMetricsEndpoints"]:
                assert set(endpoint) <= {"port", "path", "interval"}
                assert endpoint["port"] in ports(c) and endpoint["path"] == "/metrics"
                assert re.fullmatch(r"\d+s", endpoint["interval"])
    assert scraped == set(ROLES)  # the gateway carries the HPAs' metric
    # job = the component label: the job names the Grafana dashboard queries
    dashboard = (ROOT / "docker/monitoring/grafana/dashboards/pdserve.json").read_text()
    assert set(re.findall(r'job=\\"(\w+)\\"', dashboard)) == set(ROLES)


def test_every_service_selects_one_pool_and_its_named_ports(objs):
    for name, service in of_kind(objs, "Service").items():
        [p] = selected_pods(objs, {"matchLabels": service["spec"]["selector"]})
        [c] = p["spec"]["containers"]
        for port in service["spec"]["ports"]:
            assert ports(c)[port["targetPort"]] == port["port"], (name, port)
    services = of_kind(objs, "Service")
    for role in ("prefill", "decode"):  # headless: DNS names the pods themselves
        assert services[f"pdserve-{role}"]["spec"]["clusterIP"] == "None"
    # the gateway is not ready before nodes register, and they register through this one,
    # headless: its name resolves to every gateway pod, and nodes register with each
    control = services["pdserve-gateway-control"]["spec"]
    assert control["publishNotReadyAddresses"] is True and control["clusterIP"] == "None"
    gateways = of_kind(objs, "Deployment")["pdserve-gateway"]["spec"]
    assert gateways["replicas"] > 1 and gateways["strategy"]["type"] == "RollingUpdate"


def test_evictions_take_one_pod_of_a_pool_at_a_time(objs):
    budgets = of_kind(objs, "PodDisruptionBudget")
    assert set(budgets) == {f"pdserve-{role}" for role in ROLES}
    for role in ROLES:
        spec = budgets[f"pdserve-{role}"]["spec"]
        assert selected_pods(objs, spec["selector"]) == [pod(objs, role)]
        assert spec["maxUnavailable"] == 1 and "minAvailable" not in spec
    # with two gateways, an eviction always leaves one serving
    assert of_kind(objs, "Deployment")["pdserve-gateway"]["spec"]["replicas"] > 1


def test_nodes_register_through_the_control_service(objs):
    services = of_kind(objs, "Service")
    gw = env(container(objs, "gateway"))
    for role in ("prefill", "decode"):
        address = env(container(objs, role))["PDSERVE_GATEWAY"]
        host, port = re.fullmatch(r"tcp://([\w-]+):(\d+)", address).groups()
        [service_port] = [p for p in services[host]["spec"]["ports"] if p["port"] == int(port)]
        selector = {"matchLabels": services[host]["spec"]["selector"]}
        assert selected_pods(objs, selector) == [pod(objs, "gateway")]
        assert ports(container(objs, "gateway"))[service_port["targetPort"]] == int(
            gw["PDSERVE_CONTROL_PORT"]
        )
    # tokens go to the host the node registered through (common/node/host.py): same Service
    assert {p["port"] for p in services[host]["spec"]["ports"]} >= {int(gw["PDSERVE_TOKENS_PORT"])}


def test_ports_in_env_are_the_named_container_ports(objs):
    names = {
        "PDSERVE_PORT": "http",
        "PDSERVE_CONTROL_PORT": "control",
        "PDSERVE_TOKENS_PORT": "tokens",
        "PDSERVE_METRICS_PORT": "metrics",
        "PDSERVE_DATA_PORT": "data",
        "PDSERVE_KV_TCP_PORT": "kv-tcp",
    }
    for role in ROLES:
        c = container(objs, role)
        values = env(c)
        for variable, port in names.items():
            if variable in values:
                assert ports(c)[port] == int(values[variable]), (role, variable)
        # every listening port is one pdserve is told to use (none left "any free")
        assert {names[v] for v in values if v in names} == set(ports(c)), role


def test_probes_health_for_readiness_never_for_liveness(objs):
    for role in ROLES:
        c = container(objs, role)
        port = "http" if role == "gateway" else "metrics"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"]["port"] == port and port in ports(c), (role, probe)
        # /health is 503 while a node drains (and while the gateway has no nodes): not ready,
        # but alive; a node's /live is 503 only while its engine is hung, the gateway's
        # /metrics answers as long as the process does
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        # a loop busy for a second (2 cores, a burst) is not unready: 1 s, the default, took
        # every gateway out of its Service at once under load
        assert c["readinessProbe"].get("timeoutSeconds", 1) >= 5, role
        live = "/metrics" if role == "gateway" else "/live"
        assert c["livenessProbe"]["httpGet"]["path"] == live
    assert ports(container(objs, "gateway"))["http"] == 8000


def test_nodes_drain_within_the_grace_period_and_advertise_their_pod_ip(objs):
    for role in ("prefill", "decode"):
        spec = pod(objs, role)["spec"]
        drain = float(env(container(objs, role))["PDSERVE_DRAIN_TIMEOUT"])
        assert spec["terminationGracePeriodSeconds"] >= drain + 15
        by_name = {e["name"]: e for e in container(objs, role)["env"]}
        advertise = by_name["PDSERVE_ADVERTISE_HOST"]
        assert advertise["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    for role in ROLES:  # service links would set PDSERVE_GATEWAY_PORT and the like
        assert pod(objs, role)["spec"]["enableServiceLinks"] is False
    # the gateway: streams in flight get aiohttp's 60 s, after a preStop wait that lets the
    # Service drop the pod before its listener closes
    gateway = pod(objs, "gateway")["spec"]
    wait = container(objs, "gateway")["lifecycle"]["preStop"]["exec"]["command"]
    assert wait[0] == "sleep" and gateway["terminationGracePeriodSeconds"] >= 60 + float(wait[1])


def test_every_process_reads_the_cluster_key_from_the_secret(objs, tmp_path):
    secrets = of_kind(objs, "Secret")
    for role in ROLES:
        spec = pod(objs, role)["spec"]
        c = container(objs, role)
        volumes = {v["name"]: v for v in spec["volumes"]}
        key_path = Path(env(c)["PDSERVE_CLUSTER_KEY"])
        [mount] = [m for m in c["volumeMounts"] if key_path.parent == Path(m["mountPath"])]
        secret = secrets[volumes[mount["name"]]["secret"]["secretName"]]
        data = base64.b64decode(secret["data"][key_path.name])
        (tmp_path / role).write_bytes(data)
        ClusterKey.load(tmp_path / role)  # the file pdserve keygen wrote, intact
        for v in volumes.values():  # and no volume names a Secret that is not there
            assert "secret" not in v or v["secret"]["secretName"] in secrets


def test_hpas_scale_the_pools_on_the_gateways_desired_replicas(objs):
    deployments = of_kind(objs, "Deployment")
    hpas = of_kind(objs, "HorizontalPodAutoscaler")
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()} == {
        "pdserve-prefill",
        "pdserve-decode",
    }
    for hpa in hpas.values():
        target = hpa["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment" and target["apiVersion"] == "apps/v1"
        deployment = deployments[target["name"]]
        assert "replicas" not in deployment["spec"]  # the HPA owns it; apply must not reset it
        [metric] = hpa["spec"]["metrics"]
        assert metric["type"] == "External"
        assert metric["external"]["metric"]["name"] == "pdserve_desired_replicas"
        pool = deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        assert metric["external"]["metric"]["selector"] == {"matchLabels": {"pool": pool}}
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    # the series the adapter rule reads is the one the gateway exports, with its pool label
    pools = {"prefill": 3, "decode": 2}
    gateway = GatewayMetrics(ClusterView(heartbeat_timeout=5.0), RequestTable(), [], lambda: pools)
    families = {f.name: f for f in text_string_to_metric_families(gateway.render().decode())}
    samples = families["pdserve:desired_replicas"].samples
    assert {sample.labels["pool"]: sample.value for sample in samples} == pools
    rule = 'name: {as: "pdserve_desired_replicas"}'
    assert rule in (ROOT / "docs/autoscaling.md").read_text()
    assert rule in (K8S / "base" / "hpa.yaml").read_text()


def test_gpus_only_in_the_gpu_overlay(overlays):
    for role in ROLES:
        cpu, gpu = container(overlays["cpu"], role), container(overlays["gpu"], role)
        assert "nvidia.com/gpu" not in cpu.get("resources", {}).get("limits", {})
        if role == "gateway":
            assert "nvidia.com/gpu" not in gpu["resources"]["limits"]
            continue
        assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert env(gpu)["PDSERVE_DEVICE"] == "cuda" and env(gpu)["PDSERVE_DTYPE"] == "bfloat16"
        assert env(cpu)["PDSERVE_DEVICE"] == "cpu" and env(cpu)["PDSERVE_DTYPE"] == "float32"
        # never "auto" on CPU: pods timing the kernel each could choose differently, and the
        # gateway refuses a node whose numerics differ from the others'
        assert env(cpu)["PDSERVE_QUANTIZATION"] in ("int4", "none")
        assert {"cpu", "memory"} <= set(cpu["resources"]["requests"])
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(overlays["cpu"])


def _source_names() -> set[str]:
    """PDSERVE_* names written out in pdserve's code (read outside the config classes)."""
    names: set[str] = set()
    for folder, _, files in os.walk(ROOT / "pdserve", followlinks=True):
        for f in files:
            if f.endswith(".py"):
                names |= set(re.findall(r"PDSERVE_[A-Z0-9_]+", (Path(folder) / f).read_text()))
    return names


def test_every_pdserve_variable_is_a_setting_of_its_role(objs, monkeypatch):
    literal = _source_names()
    assert "PDSERVE_LOG_LEVEL" in literal  # the scan finds what cli.py reads
    classes = {"gateway": (GatewayConfig,), "node": (NodeConfig, EngineConfig)}
    for role in ROLES:
        kind = "gateway" if role == "gateway" else "node"
        fields = [f for cls in classes[kind] for f in dataclasses.fields(cls)]
        known = {f"PDSERVE_{f.name.upper()}" for f in fields} | literal
        values = env(container(objs, role))
        assert set(values) <= known, f"{role}: {sorted(set(values) - known)} are not read"
        for name in [n for n in os.environ if n.startswith("PDSERVE_")]:
            monkeypatch.delenv(name)
        for name, value in values.items():
            monkeypatch.setenv(name, value)
        configs = [from_args(cls) for cls in classes[kind]]  # a bad value raises here
        assert configs[0].cluster_key == values["PDSERVE_CLUSTER_KEY"]
        assert isinstance(logging.getLevelName(values["PDSERVE_LOG_LEVEL"]), int)


def test_images_are_the_repositorys(objs):
    for role in ROLES:
        c = container(objs, role)
        assert c["image"] == "pdserve:latest" and c["imagePullPolicy"] == "IfNotPresent"
        assert c["args"] == [role]  # the image's entrypoint is `pdserve`


def test_the_renderer_refuses_what_it_does_not_implement(tree, tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: [a.yaml]\ncommonLabels: {a: b}\n")
    with pytest.raises(Unsupported, match="commonLabels"):
        render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text("resources: [a.yaml]\n")
    (tmp_path / "a.yaml").write_text("kind: Pod\nmetadata: &m {name: a}\nx: *m\n")
    with pytest.raises(Unsupported, match="anchors"):
        render(tmp_path)
    missing = tmp_path / "copy"
    shutil.copytree(tree, missing, ignore=shutil.ignore_patterns("cluster.key"))
    with pytest.raises(FileNotFoundError, match=r"cluster\.key"):
        render(missing / "overlays" / "gpu")


def test_strategic_merge_by_patch_merge_keys():
    base = {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}], "args": ["p"]}]}
    patch = {"containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}], "args": ["q"]}]}
    merged = merge(base, patch)
    assert merged["containers"][0]["env"] == [
        {"name": "X", "value": "1"},
        {"name": "Y", "value": "2"},
    ]
    assert merged["containers"][0]["args"] == ["q"]  # no merge key: replaced
    assert merge({"a": 1, "b": 2}, {"a": None}) == {"b": 2}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_port_a_node_listens_on_is_fixed(objs, role, monkeypatch):
    """A NetworkPolicy names ports: a node port left at 0 binds any free one (the prefill
    pods' tcp KV listener did, for the prefix fetches peers make there). The ports come
    from what the node probes before it starts (pdserve/ports.py), each flag's variable."""
    import pdserve.ports

    bound: list[str] = []
    monkeypatch.setattr(pdserve.ports, "_bindable", lambda host, port, name: bound.append(name))
    fields = {f.name for f in dataclasses.fields(NodeConfig) if f.name.endswith("_port")}
    pdserve.ports.node_ports_free(NodeConfig(**dict.fromkeys(fields, 1)), role)
    values = env(container(objs, role))
    assert bound
    for flag in bound:
        variable = "PDSERVE_" + flag.removeprefix("--").replace("-", "_").upper()
        assert int(values.get(variable, "0")) > 0, (role, variable)
