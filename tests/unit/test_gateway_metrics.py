"""The gateway's cluster-wide counters stay counters while nodes come and go."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.wire.protocol import Load
from pdserve.gateway.cluster import ClusterView
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.table import RequestTable
from tests.unit.test_policies import make_info


def _load(queries: int, hits: int) -> Load:
    return Load(running=0, waiting=0, blocks_free=1, blocks_cached=0, blocks_in_use=0,
                prefix_queries=queries, prefix_hits=hits)  # fmt: skip


def _scrape(metrics: GatewayMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip


def _total(metrics: GatewayMetrics) -> float:
    return _scrape(metrics)[("pdserve:cluster_prefix_cache_hits_total", ())]


def test_cluster_prefix_counters_never_fall_as_nodes_leave_restart_or_switch():
    view = ClusterView(heartbeat_timeout=2.0)
    metrics = GatewayMetrics(view, RequestTable(), [])
    for name in ("p0", "p1"):
        assert view.register(make_info(name), f"{name}/1".encode(), 0.0, "t") is None
    # registered, no heartbeat yet: its counts are unknown, so no per-node series (not a 0)
    assert not any(k[0] == "pdserve:prefix_cache_hits_total" for k in _scrape(metrics))
    view.heartbeat("p0", b"p0/1", _load(8000, 5000), 1.0)
    view.heartbeat("p1", b"p1/1", _load(8000, 5000), 1.0)
    assert _total(metrics) == 10000
    view.remove("p1")  # dropped: what it found stays counted
    assert _total(metrics) == 10000
    # the same process registers again and reports what it had plus 100: counted once
    assert view.register(make_info("p1"), b"p1/1", 2.0, "t") is None
    view.heartbeat("p1", b"p1/1", _load(8100, 5100), 2.0)
    assert _total(metrics) == 10100
    # a role switch rebuilds p0's engine (its counts start again): what it finds adds on
    view.heartbeat("p0", b"p0/1", _load(30, 20), 3.0)
    assert _total(metrics) == 10120
    view.remove("p0")  # p0 restarts as a new process with a new identity
    assert view.register(make_info("p0"), b"p0/2", 4.0, "t") is None
    view.heartbeat("p0", b"p0/2", _load(10, 7), 4.0)
    assert _total(metrics) == 10127
    assert _scrape(metrics)[("pdserve:prefix_cache_hits_total",
                             (("node", "p0"), ("role", "prefill")))] == 7  # fmt: skip
