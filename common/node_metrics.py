"""Every node's own Prometheus metrics and health, served over HTTP on `--metrics-port`.

The gateway already exports a cluster view built from heartbeats; these are what the node
itself measures, with vLLM's names where one exists, so a Prometheus scraping each process
(the compose `monitoring` profile) sees the engine side directly: running and waiting
requests, KV usage, offers accepted and rejected, queue and prefill time, KV transfer bytes
and time, decode step time. Labels: `node` and `role`, the same as the gateway's.

`GET /health` answers 200 while the node is registered with a gateway, its engine is not hung
and it is not draining (a container healthcheck: a node that cannot reach the gateway is not
serving), else 503. `GET /live` answers 503 only while the engine is hung (one step running
past `--step-timeout`): the liveness probe, which must not restart a draining node.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.common.wire.protocol import Load
from pdserve.common.wire.security import REFUSALS

if TYPE_CHECKING:  # imported where the server starts: most nodes serve no --metrics-port
    from aiohttp import web

log = logging.getLogger(__name__)

# `*_created` series double every counter and histogram for a timestamp nobody graphs
disable_created_metrics()

# seconds; wide enough for a CPU decode step (tens of ms) and a long GPU prefill (seconds)
BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.08,
    0.15,
    0.3,
    0.6,
    1.0,
    2.0,
    4.0,
    8.0,
    16.0,
    32.0,
)


class _LoadCollector(Collector):
    """Gauges read from the node's `load()` at scrape time (no bookkeeping to go stale)."""

    def __init__(self, node: str, role: str, load: Callable[[], Load], num_blocks: int) -> None:
        self.key = [node, role]
        self.load = load
        self.num_blocks = max(1, num_blocks)

    def collect(self) -> Iterator[Metric]:
        labels = ["node", "role"]
        load = self.load()
        running = GaugeMetricFamily(
            "pdserve:num_requests_running", "Requests in the engine", labels=labels
        )
        running.add_metric(self.key, load.running)
        waiting = GaugeMetricFamily(
            "pdserve:num_requests_waiting",
            "Requests queued on the node or with KV in transfer",
            labels=labels,
        )
        waiting.add_metric(self.key, load.waiting)
        usage = GaugeMetricFamily(
            "pdserve:kv_cache_usage_perc", "Fraction of KV blocks in use", labels=labels
        )
        usage.add_metric(self.key, load.blocks_in_use / self.num_blocks)
        blocks = GaugeMetricFamily(
            "pdserve:kv_blocks", "KV blocks by state", labels=[*labels, "state"]
        )
        for state, value in (
            ("in_use", load.blocks_in_use),
            ("cached", load.blocks_cached),
            ("free", load.blocks_free),
        ):
            blocks.add_metric([*self.key, state], value)
        draining = GaugeMetricFamily(
            "pdserve:node_draining", "1 while the node drains", labels=labels
        )
        draining.add_metric(self.key, int(load.draining))
        yield from (running, waiting, usage, blocks, draining)
        yield from prefix_counters([(self.key, load)])
        yield refused_peers(labels, self.key)


class _TierCollector(Collector):
    def __init__(self, labels: dict[str, str], stats: Callable[[], dict[str, int]]) -> None:
        self.labels, self.stats = labels, stats

    def collect(self) -> Iterator[Metric]:
        doc = "KV blocks through the prefix cache's host and disk tiers, by event"
        family = CounterMetricFamily("pdserve:kv_tier_blocks", doc, labels=[*self.labels, "event"])
        for event, count in self.stats().items():
            family.add_metric([*self.labels.values(), event], count)
        yield family


def refused_peers(labels: list[str], key: list[str]) -> Metric:
    """This process's refusals of peers without the cluster key, by kind."""
    refused = CounterMetricFamily(
        "pdserve:refused_peers", "Peers refused for want of the cluster key (--cluster-key)",
        labels=[*labels, "kind"],
    )  # fmt: skip
    for kind, count in REFUSALS.counts.items():
        refused.add_metric([*key, kind], count)
    return refused


def prefix_counters(loads: list[tuple[list[str], Load]]) -> Iterator[Metric]:
    """vLLM's prefix-cache counters (in tokens), per node, from load reports."""
    queries = CounterMetricFamily(
        "pdserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
        labels=["node", "role"],
    )  # fmt: skip
    hits = CounterMetricFamily(
        "pdserve:prefix_cache_hits", "Prompt tokens found in the prefix cache",
        labels=["node", "role"],
    )  # fmt: skip
    fetched = CounterMetricFamily(
        "pdserve:prefix_cache_fetched_tokens",
        "Of the hits, prompt tokens whose KV was fetched from another node's cache",
        labels=["node", "role"],
    )
    for key, load in loads:
        queries.add_metric(key, load.prefix_queries)
        hits.add_metric(key, load.prefix_hits)
        fetched.add_metric(key, load.prefix_fetched)
    yield from (queries, hits, fetched)


class NodeMetrics:
    def __init__(self, node: str, role: str, load: Callable[[], Load], num_blocks: int) -> None:
        self.registry = r = CollectorRegistry()
        labels = {"node": node, "role": role}
        names = list(labels)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            c = Counter(name, doc, [*names, *extra], registry=r)
            return c if extra else c.labels(**labels)

        def histogram(name: str, doc: str, extra: tuple[str, ...] = ()) -> Histogram:
            h = Histogram(name, doc, [*names, *extra], buckets=BUCKETS, registry=r)
            return h if extra else h.labels(**labels)

        self.labels = labels
        self._offers = counter("pdserve:offers", "Prefill offers by decision", ("decision",))
        self.prompt_tokens = counter("pdserve:prompt_tokens", "Prompt tokens prefilled")
        self.generation_tokens = counter("pdserve:generation_tokens", "Tokens generated")
        self.preemptions = counter("pdserve:num_preemptions", "Sequences preempted")
        self.migrations = counter(
            "pdserve:kv_migrations", "Running sequences moved off this node with their KV"
        )
        self.local_prefills = counter(
            "pdserve:local_prefills", "Decode node: prompts prefilled here (--local-prefill)"
        )
        self.queue_time = histogram(
            "pdserve:request_queue_time_seconds", "Accepted until its prefill started"
        )
        self.prefill_time = histogram(
            "pdserve:request_prefill_time_seconds", "Forward pass of the batch that held it"
        )
        self.step_time = histogram("pdserve:engine_step_seconds", "One engine step (decode: ITL)")
        self.step_failures = counter(
            "pdserve:engine_step_failures", "Engine steps that raised (their batch failed)"
        )
        self._kv_bytes = counter(
            "pdserve:kv_transfer_bytes", "KV bytes sent or received", ("backend", "direction")
        )
        self._kv_seconds = histogram(
            "pdserve:kv_transfer_seconds", "First KV byte sent until the peer's ack", ("backend",)
        )
        self._kv_overlap = histogram(
            "pdserve:kv_transfer_overlap_seconds",
            "Of the KV transfer, the part that ran while the prefill pass still computed",
            ("backend",),
        )
        self._layerwise = counter(
            "pdserve:kv_send_batches",
            "Prefill batches by how their KV went out: layerwise or at_end, and why",
            ("mode", "why"),
        )
        self._fetches = counter(
            "pdserve:kv_fetches",
            "Prefix fetches between nodes: fetched, fell_back (recomputed), served (to a peer)",
            ("result",),
        )
        self._orphans = counter(
            "pdserve:orphans",
            "Streams whose gateway went silent or let them go (docs/architecture.md, resume):"
            " adopted, or freed at --orphan-grace's end while running (lost) or ended;"
            " given_back: preempted while an orphan (its adopter places it again)",
            ("outcome",),
        )
        self.gateway_silences = counter(
            "pdserve:gateway_silences",
            "Times a gateway said nothing for --heartbeat-timeout: its requests became orphans",
        )
        r.register(_LoadCollector(node, role, load, num_blocks))

    def kv_tiers(self, stats: Callable[[], dict[str, int]]) -> None:
        """pdserve:kv_tier_blocks_total{event}: the prefix cache's lower tiers' block counts
        (common/engine/tiers.py: put, spilled, host_hits, disk_hits, corrupt, dropped)."""
        self.registry.register(_TierCollector(self.labels, stats))

    def orphans(self, outcome: str, n: int) -> None:
        self._orphans.labels(**self.labels, outcome=outcome).inc(n)

    def engine_info(self, dtype: str, quantization: str, kernels: str) -> None:
        """pdserve:engine_info{dtype,quantization,kernels} = 1: which path this node runs (kernels
        "fused", "fused+gguf", "fused+f32", "eager" when the C kernels did not build, "sim")."""
        names = [*self.labels, "dtype", "quantization", "kernels"]
        doc = "The engine's numerics and code path (value 1)"
        info = Gauge("pdserve:engine_info", doc, names, registry=self.registry)
        info.labels(**self.labels, dtype=dtype, quantization=quantization, kernels=kernels).set(1)

    def kv_send_mode(self, layerwise: bool, why: str) -> None:
        mode = "layerwise" if layerwise else "at_end"
        self._layerwise.labels(**self.labels, mode=mode, why=why).inc()

    def fetch(self, result: str) -> None:
        self._fetches.labels(**self.labels, result=result).inc()

    def offer(self, accepted: bool) -> None:
        self._offers.labels(**self.labels, decision="accept" if accepted else "reject").inc()

    def kv_sent(self, backend: str, nbytes: int, seconds: float, overlap: float) -> None:
        """One handoff: first KV byte sent to the ack, and the part of it that ran while the
        prefill pass still computed."""
        self._kv_bytes.labels(**self.labels, backend=backend, direction="out").inc(nbytes)
        self._kv_seconds.labels(**self.labels, backend=backend).observe(seconds)
        self._kv_overlap.labels(**self.labels, backend=backend).observe(overlap)

    def kv_received(self, backend: str, nbytes: int) -> None:
        self._kv_bytes.labels(**self.labels, backend=backend, direction="in").inc(nbytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def start_http(
    metrics: NodeMetrics,
    healthy: Callable[[], str | None],
    hung: Callable[[], str | None],
    host: str,
    port: int,
) -> web.AppRunner:
    """Serve /metrics, /health and /live; `healthy()` returns None when serving, else why
    not; `hung()` why the process should be restarted (a liveness probe), else None."""
    from aiohttp import web

    async def get_metrics(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), content_type="text/plain", charset="utf-8")

    def answer(reason: str | None) -> web.Response:
        if reason is None:
            return web.json_response({"status": "ok", **metrics.labels})
        return web.json_response({"status": "unavailable", "reason": reason}, status=503)

    async def get_health(request: web.Request) -> web.Response:
        return answer(healthy())

    async def get_live(request: web.Request) -> web.Response:
        return answer(hung())

    app = web.Application()
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/health", get_health)
    app.router.add_get("/live", get_live)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("%s metrics on http://%s:%d/metrics", metrics.labels["node"], host, port)
    return runner
