"""The Prometheus and Grafana files of the compose `monitoring` profile (docker/monitoring).

A dashboard query that names a metric nobody exports (a typo, a rename, the wrong job) shows
an empty panel and no error anywhere, so every expr is checked against the registries the
gateway and the nodes really build; the scrape and provisioning files are checked against the
jobs, datasource uid and paths the dashboard and the compose file rely on.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from pdserve.common.node_metrics import NodeMetrics
from pdserve.common.wire.protocol import Load
from pdserve.gateway.cluster import ClusterView
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.table import RequestTable

ROOT = Path(__file__).resolve().parents[2] / "docker" / "monitoring"
DASHBOARD = ROOT / "grafana" / "dashboards" / "pdserve.json"
DATASOURCES = ROOT / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = ROOT / "grafana" / "provisioning" / "dashboards" / "pdserve.yml"

SELECTOR = re.compile(r"(pdserve:[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
Samples = dict[str, list[dict[str, str]]]  # sample name -> label sets


def _samples(metrics: object, registry: CollectorRegistry) -> Samples:
    for m in vars(metrics).values():  # a labelled metric yields no sample until it has a child
        if isinstance(m, MetricWrapperBase) and m._labelnames and not m._labelvalues:
            m.labels(*["x"] * len(m._labelnames))
    out: Samples = {}
    for family in registry.collect():
        for s in family.samples:
            out.setdefault(s.name, []).append(s.labels)
    return out


@pytest.fixture(scope="module")
def exported() -> dict[str, Samples]:
    """Job name -> what that job's targets export."""
    gateway = GatewayMetrics(ClusterView(heartbeat_timeout=5.0), RequestTable(), [])
    load = Load(running=0, waiting=0, blocks_free=1, blocks_cached=0, blocks_in_use=0)
    node = NodeMetrics("n0", "prefill", lambda: load, 100)
    node.offer(False)
    node.kv_sent("zmq", 1024, 0.01, 0.005)
    node.kv_received("zmq", 1024)
    nodes = _samples(node, node.registry)  # decode nodes build the same registry
    return {"gateway": _samples(gateway, gateway.registry), "prefill": nodes, "decode": nodes}


def _panels() -> list[dict]:
    def walk(panels: list[dict]) -> list[dict]:
        return [q for p in panels for q in [p, *walk(p.get("panels", []))]]

    return [p for p in walk(json.loads(DASHBOARD.read_text())["panels"]) if p["type"] != "row"]


def _unexported(expr: str, exported: dict[str, Samples]) -> list[str]:
    """What `expr` selects that no target of the job it names exports."""
    selectors = SELECTOR.findall(expr)
    if not selectors:
        return [f"no pdserve metric in {expr!r}"]
    problems = []
    for name, body in selectors:
        matchers = {k: (op, v) for k, op, v in MATCHER.findall(body)}
        op, value = matchers.pop("job", ("", ""))
        jobs = value.split("|") if op == "=~" else [value] if op == "=" else []
        if not jobs or not set(jobs) <= set(exported):
            problems.append(f"{name}: job matcher {op}{value!r} names no known job")
        for job in set(jobs) & set(exported):
            if name not in exported[job]:
                problems.append(f"{name}: not exported by job {job}")
                continue
            for label, (lop, lvalue) in matchers.items():
                if lop == "=" and not any(s.get(label) == lvalue for s in exported[job][name]):
                    problems.append(f'{name}: job {job} has no sample with {label}="{lvalue}"')
    return problems


def test_dashboard_identity_and_panels() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert (dash["uid"], dash["title"], dash["refresh"]) == ("pdserve", "pdserve", "5s")
    panels = _panels()
    assert len(panels) >= 10
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"
    ds_uid = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]["uid"]
    assert ds_uid == "pdserve-prom"
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": ds_uid}, p["title"]
        exprs = [t.get("expr", "").strip() for t in p.get("targets", [])]
        assert any(exprs), f"{p['title']}: no target with an expr"
        for t in p["targets"]:
            assert t.get("datasource", p["datasource"])["uid"] == ds_uid, p["title"]


def test_gateway_figures_are_summed_over_the_gateways() -> None:
    """With several gateways each counts its own requests: a panel of one unsummed series
    per gateway showed two lines under one legend, neither the cluster's figure."""
    for p in _panels():
        for t in p["targets"]:
            expr = t["expr"]
            if 'job="gateway"' in expr and "histogram_quantile" not in expr:
                assert re.match(r"\s*(sum|max|min|avg|count)\b", expr), (p["title"], expr)


def test_dashboard_panels_do_not_overlap() -> None:
    rects = [(p["title"], p["gridPos"]) for p in _panels()]
    for title, g in rects:
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["x"] + g["w"] <= 24, title
    for (ta, a), (tb, b) in itertools.combinations(rects, 2):
        overlap = (
            a["x"] < b["x"] + b["w"]
            and b["x"] < a["x"] + a["w"]
            and a["y"] < b["y"] + b["h"]
            and b["y"] < a["y"] + a["h"]
        )
        assert not overlap, f"panels {ta!r} and {tb!r} overlap: {a} {b}"


def test_every_queried_metric_is_exported(exported: dict[str, Samples]) -> None:
    problems = [
        f"{p['title']}: {problem}"
        for p in _panels()
        for t in p["targets"]
        for problem in _unexported(t["expr"], exported)
    ]
    assert not problems, "\n".join(problems)


def test_the_metric_check_catches_mistakes(exported: dict[str, Samples]) -> None:
    assert _unexported('rate(pdserve:requests_totl{job="gateway"}[1m])', exported)
    assert _unexported('pdserve:engine_step_seconds_bucket{job="gateway"}', exported)
    assert _unexported('pdserve:kv_transfer_bytes_total{job="prefill",direction="up"}', exported)
    assert _unexported("pdserve:kv_cache_usage_perc", exported)  # no job: ambiguous
    assert not _unexported('pdserve:kv_cache_usage_perc{job=~"prefill|decode"}', exported)


def test_prometheus_scrapes_gateway_and_every_node_replica(exported: dict[str, Samples]) -> None:
    cfg = yaml.safe_load((ROOT / "prometheus.yml").read_text())
    assert cfg["global"]["scrape_interval"] == "5s"
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == set(exported) == {"gateway", "prefill", "decode"}
    gateway = jobs["gateway"]
    assert gateway.get("metrics_path", "/metrics") == "/metrics"
    # every gateway (compose.ha.yaml's second one too: it was never scraped)
    (sd,) = gateway["dns_sd_configs"]
    assert (sd["names"], sd["type"], sd["port"]) == (["gateway", "gateway-b"], "A", 8000)
    for role in ("prefill", "decode"):
        (sd,) = jobs[role]["dns_sd_configs"]  # one A record per `--scale` replica
        assert (sd["names"], sd["type"], sd["port"]) == ([role], "A", 9100)
        assert "static_configs" not in jobs[role]


def test_grafana_provisioning_points_at_prometheus_and_the_dashboards() -> None:
    (ds,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert (ds["name"], ds["type"]) == ("Prometheus", "prometheus")
    assert ds["url"] == "http://prometheus:9090" and ds["isDefault"] is True
    (provider,) = yaml.safe_load(PROVIDERS.read_text())["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
