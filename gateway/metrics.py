"""Prometheus metrics of the gateway, named `pdserve:` + vLLM's name where one exists.

Counters and histograms are updated as requests flow; per-node gauges (running, waiting,
in prefill, KV blocks by state) are read from the cluster view at scrape time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.common.kv_backends import BACKENDS
from pdserve.common.node_metrics import prefix_counters, refused_peers
from pdserve.gateway.cluster import EMPTY_LOAD, ClusterView
from pdserve.gateway.table import RequestTable

# `*_created` series double every counter and histogram for a timestamp nobody graphs
disable_created_metrics()

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


class ClusterCollector(Collector):
    def __init__(
        self,
        cluster: ClusterView,
        table: RequestTable,
        waiting: object,
        desired: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.cluster = cluster
        self.table = table
        self.waiting = waiting  # anything with __len__: requests waiting for placement
        self.desired = desired  # pool -> desired replicas (gateway/sizing.py)

    def collect(self) -> Iterator[Metric]:
        labels = ["node", "role"]
        running = GaugeMetricFamily(
            "pdserve:num_requests_running", "Requests in the engine", labels=labels
        )
        waiting = GaugeMetricFamily(
            "pdserve:num_requests_waiting", "Requests queued or in transfer", labels=labels
        )
        prefill = GaugeMetricFamily(
            "pdserve:requests_in_prefill", "Requests the gateway has in prefill", labels=["node"]
        )
        usage = GaugeMetricFamily(
            "pdserve:kv_cache_usage_perc", "Fraction of KV blocks in use", labels=labels
        )
        blocks = GaugeMetricFamily(
            "pdserve:kv_blocks", "KV blocks by state", labels=[*labels, "state"]
        )
        others = GaugeMetricFamily(
            "pdserve:node_requests_other_gateways",
            "Requests a node holds for the other gateways of the cluster", labels=labels,
        )  # fmt: skip
        for node in self.cluster.nodes.values():
            key = [node.node_id, node.info.role]
            load = node.load
            running.add_metric(key, load.running)
            others.add_metric(key, len(node.foreign.prefill) + node.foreign.decoding)
            waiting.add_metric(key, load.waiting)
            if node.info.role == "prefill":
                prefill.add_metric([node.node_id], len(self.table.in_prefill(node.node_id)))
            total = max(1, node.info.num_blocks)
            usage.add_metric(key, load.blocks_in_use / total)
            for state, value in (
                ("in_use", load.blocks_in_use),
                ("cached", load.blocks_cached),
                ("free", load.blocks_free),
            ):
                blocks.add_metric([*key, state], value)
        gw_waiting = GaugeMetricFamily(
            "pdserve:gateway_requests_waiting", "Requests waiting at the gateway for a prefill node"
        )
        gw_waiting.add_metric([], len(self.waiting))  # type: ignore[arg-type]
        in_flight = GaugeMetricFamily(
            "pdserve:gateway_attempts_in_flight",
            "Placement attempts in the gateway's request table (placed, in prefill or decoding)",
        )
        in_flight.add_metric([], len(self.table))
        stalled = CounterMetricFamily(
            "pdserve:gateway_stall_seconds", "Stalls of this gateway's loop past its liveness "
            "tick (0.25 s): node leases were extended by as much, so detection is later",
        )  # fmt: skip
        stalled.add_metric([], self.cluster.stalled_s)
        yield from (running, waiting, prefill, usage, blocks, others, gw_waiting, in_flight)
        yield from (stalled, refused_peers([], []))
        if self.desired is not None:
            desired = GaugeMetricFamily(
                "pdserve:desired_replicas",
                "Replicas each pool needs for its current load (the autoscaling signal)",
                labels=["pool"],
            )
            for pool, count in self.desired().items():
                desired.add_metric([pool], count)
            yield desired
        # per node, from heartbeats (none before a node's first: its counts are not known)
        reported = (n for n in self.cluster.nodes.values() if n.load is not EMPTY_LOAD)
        yield from prefix_counters([([n.node_id, n.info.role], n.load) for n in reported])
        total_q = CounterMetricFamily(
            "pdserve:cluster_prefix_cache_queries", "Prompt tokens looked up, every node"
        )
        total_h = CounterMetricFamily(
            "pdserve:cluster_prefix_cache_hits", "Prompt tokens found cached, every node"
        )
        total_f = CounterMetricFamily(
            "pdserve:cluster_prefix_cache_fetched_tokens",
            "Of the hits, tokens fetched from another node's cache, every node",
        )
        totals = self.cluster.prefix_totals
        total_q.add_metric([], totals.queries)
        total_h.add_metric([], totals.hits)
        total_f.add_metric([], totals.fetched)
        yield from (total_q, total_h, total_f)


class GatewayMetrics:
    def __init__(
        self,
        cluster: ClusterView,
        table: RequestTable,
        waiting: object,
        desired: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdserve:requests", "Finished requests by outcome", ["outcome"], registry=r
        )
        self.http = Counter(
            "pdserve:http_responses", "HTTP answers by status code, refusals included",
            ["status"], registry=r,
        )  # fmt: skip
        self._http: dict[int, Any] = {}  # status -> its child
        self.accepts = Counter("pdserve:placement_accepts", "Offers accepted", ["node"], registry=r)
        self.rejects = Counter("pdserve:placement_rejects", "Offers rejected", ["node"], registry=r)
        self.offer_timeouts = Counter(
            "pdserve:placement_offer_timeouts",
            "Offers a node did not answer within --offer-timeout",
            ["node"],
            registry=r,
        )
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens", registry=r)
        self.node_messages = Counter(
            "pdserve:node_messages", "Messages received from nodes, by type (what a gateway's "
            "CPU follows besides its requests)", ["type"], registry=r,
        )  # fmt: skip
        self.resumes = Counter(
            "pdserve:stream_resumes", "Streams resumed here after their gateway was lost, by "
            "outcome (adopted, refused, busy)", ["outcome"], registry=r,
        )  # fmt: skip
        self.resume_rounds = Counter(
            "pdserve:stream_resume_rounds", "Rounds of asking the nodes for streams being "
            "resumed (one Adopt per node each, for every stream looked for)", registry=r,
        )  # fmt: skip
        self.generation_tokens = Counter(
            "pdserve:generation_tokens", "Generated tokens", registry=r
        )
        self.migrations = Counter(
            "pdserve:kv_migrations",
            "Sequences leaving a decode node (drain, rebalance): moved with their KV, or stayed",
            ["result"],
            registry=r,
        )
        self.role_switches = Counter(
            "pdserve:role_switches",
            "Nodes asked to take the other role (--role-switching)",
            ["from_role", "to_role"],
            registry=r,
        )
        self.local_prefills = Counter(
            "pdserve:local_prefills",
            "Requests prefilled on their decode node (--local-prefill)",
            registry=r,
        )
        self.rebalances = Counter(
            "pdserve:decode_rebalance_moves",
            "Running sequences the gateway asked a filling decode node to move (--rebalance)",
            registry=r,
        )
        self.replacements = Counter(
            "pdserve:request_replacements", "Re-placements", ["kind"], registry=r
        )
        self.ttft = Histogram(
            "pdserve:time_to_first_token_seconds", "TTFT", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "pdserve:inter_token_latency_seconds",
            "Gap between tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve:e2e_request_latency_seconds",
            "Request latency",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.placement_wait = Histogram(
            "pdserve:placement_wait_seconds",
            "Time until a prefill node accepted",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_bytes = Counter(
            "pdserve:kv_transfer_bytes", "KV bytes handed off", ["node", "backend"], registry=r
        )
        self.kv_seconds = Histogram(
            "pdserve:kv_transfer_seconds",
            "KV handoff: first KV byte sent to KvAck",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_overlap = Histogram(
            "pdserve:kv_transfer_overlap_seconds",
            "Of the KV handoff, the part that ran while the prefill pass still computed",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.phases = {
            name: Histogram(metric, doc, buckets=LATENCY_BUCKETS, registry=r)
            for name, metric, doc in (
                (
                    "prefill_queue_ms",
                    "pdserve:request_queue_time_seconds",
                    "Accepted by a prefill node until its prefill started",
                ),
                ("prefill_ms", "pdserve:request_prefill_time_seconds", "Prefill forward pass"),
                (
                    "decode_wait_ms",
                    "pdserve:request_decode_wait_seconds",
                    "First token until the first token from the decode node",
                ),
                ("tpot_ms", "pdserve:time_per_output_token_seconds", "Mean gap per request"),
            )
        }
        r.register(ClusterCollector(cluster, table, waiting, desired))

    def http_response(self, status: int) -> None:
        if (child := self._http.get(status)) is None:
            child = self._http[status] = self.http.labels(str(status))
        child.inc()

    def forget_node(self, node_id: str) -> None:
        """A node dropped: its labelled series go (pods come and go under new names; kept,
        every one ever seen stayed in /metrics). Back under its id, it starts from 0."""
        for counter in (self.accepts, self.rejects, self.offer_timeouts):
            with contextlib.suppress(KeyError):
                counter.remove(node_id)
        for backend in BACKENDS:
            with contextlib.suppress(KeyError):
                self.kv_bytes.remove(node_id, backend)

    def observe_phases(self, phases: dict[str, float]) -> None:
        """The per-request timeline summarised: one histogram per phase (gateway wait and KV
        transfer have theirs above, observed as they happen)."""
        for name, hist in self.phases.items():
            if name in phases:
                hist.observe(phases[name] / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)
