"""The per-request timeline turned into phases, the JSON log format that carries it, and a
node's own /metrics and /health over real HTTP."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request

from pdserve.common.logs import JsonFormatter, TextFormatter
from pdserve.common.node_metrics import NodeMetrics, start_http
from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.protocol import Load
from pdserve.common.wire.transport import free_port
from pdserve.gateway.requests import Done, GatewayRequest


def _request(tokenizer) -> GatewayRequest:
    return GatewayRequest(
        request_id="r1",
        kind="completion",
        model="m",
        prompt_ids=[1, 2, 3],
        params=SamplingParams(max_tokens=4),
        stream=False,
        include_usage=False,
        tokenizer=tokenizer,
    )


def test_phases_from_the_timeline(tokenizer):
    req = _request(tokenizer)
    req.timeline.update(
        {
            "placing.0": 1.0,
            "accepted.0": 6.0,
            "queue_ms.0": 2.5,
            "prefill_ms.0": 40.0,
            "kv_transfer.0": {"start_ms": 10.0, "end_ms": 55.0},  # type: ignore[dict-item]
        }
    )
    for index, token in enumerate((5, 6, 7)):
        req.add_token(index, token, None)
    req.finish(Done("length"))
    req.timeline.update({"first_token": 50.0, "decode_start": 70.0, "finish": 110.0})
    phases = req.phases()
    assert phases["gateway_wait_ms"] == 5.0
    assert phases["prefill_queue_ms"] == 2.5 and phases["prefill_ms"] == 40.0
    assert phases["kv_transfer_ms"] == 45.0
    assert phases["ttft_ms"] == 50.0 and phases["decode_wait_ms"] == 20.0
    assert phases["tpot_ms"] == 30.0  # (110 - 50) / (3 - 1)
    assert phases["e2e_ms"] == 110.0
    assert req.outcome == "length"


def test_phases_of_a_request_that_never_ran(tokenizer):
    req = _request(tokenizer)
    req.timeline["placing.0"] = 0.1
    assert req.phases() == {}


def _record(fields: dict | None) -> logging.LogRecord:
    record = logging.LogRecord(
        "pdserve.timeline", logging.INFO, __file__, 1, "request %s", ("x",), None
    )
    if fields is not None:
        record.fields = fields
    return record


def test_json_log_lines_carry_the_record_fields_at_the_top():
    line = JsonFormatter().format(_record({"event": "request", "phases": {"ttft_ms": 3.5}}))
    out = json.loads(line)
    assert out["msg"] == "request x" and out["level"] == "info"
    assert out["logger"] == "pdserve.timeline" and out["ts"].endswith("Z")
    assert out["event"] == "request" and out["phases"] == {"ttft_ms": 3.5}
    text = TextFormatter().format(_record({"event": "request"}))
    assert text.endswith('request x {"event":"request"}')
    assert "{" not in TextFormatter().format(_record(None))


def test_log_lines_name_their_level_and_process():
    """`pdserve up` interleaves every child's lines: each says which process and level."""
    from pdserve.cli import _label, build_parser, parse_args

    assert json.loads(JsonFormatter("decode-1").format(_record(None)))["process"] == "decode-1"
    assert "process" not in json.loads(JsonFormatter().format(_record(None)))
    text = TextFormatter("decode-1").format(_record(None))
    assert " INFO [decode-1] pdserve.timeline request x" in text
    labels = {}
    for argv in (["decode", "--node-id", "d-3"], ["gateway", "--port", "9001"], ["prefill"]):
        labels[argv[0]] = _label(parse_args(build_parser(argv), argv))
    assert labels == {"decode": "d-3", "gateway": "gateway:9001", "prefill": "prefill"}


def test_node_metrics_and_health_over_http():
    load = Load(running=2, waiting=1, blocks_free=90, blocks_cached=2, blocks_in_use=8)
    metrics = NodeMetrics("p0", "prefill", lambda: load, num_blocks=100)
    metrics.offer(True)
    metrics.offer(False)
    metrics.kv_sent("shm", 4096, 0.01, 0.004)
    metrics.engine_info("float32", "int4", "fused+gguf")
    state = {"reason": "not registered"}
    port = free_port()

    def get(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    async def main() -> list[tuple[int, str]]:
        runner = await start_http(metrics, lambda: state["reason"], lambda: None, "127.0.0.1",
                                  port)  # fmt: skip
        try:
            loop = asyncio.get_running_loop()
            out = [await loop.run_in_executor(None, get, "/health")]
            state["reason"] = None  # type: ignore[assignment]
            out.append(await loop.run_in_executor(None, get, "/health"))
            out.append(await loop.run_in_executor(None, get, "/metrics"))
            return out
        finally:
            await runner.cleanup()

    unhealthy, healthy, scraped = asyncio.run(main())
    assert unhealthy[0] == 503 and "not registered" in unhealthy[1]
    assert healthy[0] == 200 and json.loads(healthy[1])["node"] == "p0"
    body = scraped[1]
    assert 'pdserve:num_requests_running{node="p0",role="prefill"} 2.0' in body
    assert 'pdserve:kv_cache_usage_perc{node="p0",role="prefill"} 0.08' in body
    assert 'pdserve:offers_total{decision="reject",node="p0",role="prefill"} 1.0' in body
    assert 'backend="shm",direction="out",node="p0",role="prefill"} 4096.0' in body
    info = 'dtype="float32",kernels="fused+gguf",node="p0",quantization="int4",role="prefill"'
    assert f"pdserve:engine_info{{{info}}} 1.0" in body


def test_the_kv_tiers_block_counts_are_exported_at_scrape_time():
    stats = {"put": 3, "disk_hits": 1}
    load = Load(running=0, waiting=0, blocks_free=10, blocks_cached=0, blocks_in_use=0)
    metrics = NodeMetrics("p0", "prefill", lambda: load, num_blocks=10)
    metrics.kv_tiers(lambda: stats)
    stats["disk_hits"] = 2  # read when scraped, not when registered
    text = metrics.render().decode()
    assert 'pdserve:kv_tier_blocks_total{event="disk_hits",node="p0",role="prefill"} 2.0' in text
    assert 'pdserve:kv_tier_blocks_total{event="put",node="p0",role="prefill"} 3.0' in text
