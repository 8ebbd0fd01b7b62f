"""Serving metrics from per-request records, with vLLM's definitions (below). Pure.

    TTFT    request sent -> first chunk carrying content (server_ttft: the server's own
            figure, from its `timings`, where it reports one)
    TPOT    per request: (E2E - TTFT) / (output tokens - 1), output tokens from `usage`
    ITL     every gap between consecutive content chunks, pooled over all requests
    E2E     request sent -> last byte of the response
    goodput requests meeting every given SLO (<=) / measured duration; errors are not good
    slo_attainment  requests meeting every SLO / requests (goodput's numerator alone: over a
            short run the duration is much the drain after the last arrival, so goodput also
            counts how late the slowest requests end)
    duration first request sent (after warm-up) -> last response completed
    send lag  open loop: request sent - its scheduled arrival. TTFT starts at the send (as
            vLLM's does), so a client too busy to send on time (a loaded host) shows here

Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestRecord:
    index: int
    sent: float  # monotonic seconds
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    done: float = 0.0
    error: str = ""
    status: int = 0
    resumed: int = 0  # times its stream resumed on another gateway (loadgen/resumable.py)
    server_ttft: float | None = None  # the server's own TTFT (its `timings`), if it reports one
    # the server's wait before the request's prefill began: at the gateway for a node to
    # accept it, plus in that node's queue (its `timings`: gateway_wait + prefill_queue)
    server_wait: float | None = None
    token_ids: list[int] = field(default_factory=list)  # the output's, when asked for
    scheduled: float | None = None  # open loop: its arrival time (monotonic seconds)

    @property
    def send_lag(self) -> float | None:
        return None if self.scheduled is None else self.sent - self.scheduled

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.done - self.sent

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "ok": self.ok,
            "status": self.status,
            "error": self.error,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "ttft_ms": round(self.ttft * 1000, 3) if self.ok else None,
            "server_ttft_ms": (
                round(self.server_ttft * 1000, 3) if self.server_ttft is not None else None
            ),
            "server_wait_ms": (
                round(self.server_wait * 1000, 3) if self.server_wait is not None else None
            ),
            "tpot_ms": round(self.tpot * 1000, 3) if self.ok and self.tpot is not None else None,
            "e2e_ms": round(self.e2e * 1000, 3) if self.ok else None,
            "itl_ms": [round(x * 1000, 3) for x in self.itls] if self.ok else [],
            "send_lag_ms": round(lag * 1000, 3) if (lag := self.send_lag) is not None else None,
        }


def parse_slo(text: str) -> dict[str, float]:
    """'ttft=500,tpot=50,e2e=10000' (milliseconds) -> {'ttft': 0.5, ...} in seconds."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in ("ttft", "tpot", "e2e") or not value:
            raise ValueError(f"bad SLO {part!r}: use ttft=MS,tpot=MS,e2e=MS")
        slo[name] = float(value) / 1000
        if not 0 < slo[name] < math.inf:  # NaN or <= 0: every request would miss it
            raise ValueError(f"bad SLO {part!r}: a positive number of milliseconds")
    return slo


def meets(record: RequestRecord, slo: dict[str, float]) -> bool:
    if not record.ok:
        return False
    # one output token has no TPOT (met); none counted (no usage came) is not known to meet it
    tpot = record.tpot if record.tpot is not None else (0.0 if record.output_tokens else math.inf)
    values = {"ttft": record.ttft, "tpot": tpot, "e2e": record.e2e}
    return all(values[name] <= limit for name, limit in slo.items())


def _stats(prefix: str, values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"{prefix}_{k}": None for k in ("mean", "p50", "p90", "p99", "max")}
    arr = np.asarray(values) * 1000
    return {
        f"{prefix}_mean": round(float(arr.mean()), 3),
        f"{prefix}_p50": round(float(np.percentile(arr, 50)), 3),
        f"{prefix}_p90": round(float(np.percentile(arr, 90)), 3),
        f"{prefix}_p99": round(float(np.percentile(arr, 99)), 3),
        f"{prefix}_max": round(float(arr.max()), 3),
    }


def summarize(records: list[RequestRecord], slo: dict[str, float] | None = None) -> dict[str, Any]:
    """The summary (the keys of vLLM's benchmark), over the (post-warm-up) records given."""
    ok = [r for r in records if r.ok]
    start = min((r.sent for r in records), default=0.0)
    end = max((r.done for r in records), default=0.0)
    duration = max(end - start, 1e-9)
    summary: dict[str, Any] = {}
    summary.update(_stats("ttft_ms", [r.ttft for r in ok]))
    # the server's own view (arrival at its front end -> first token out): the difference to
    # the client's TTFT is client, network and queueing in front of the server
    summary.update(_stats("server_ttft_ms", [t for r in ok if (t := r.server_ttft) is not None]))
    # the wait bound: the longest any request waited for its prefill to begin
    summary.update(_stats("wait_ms", [t for r in ok if (t := r.server_wait) is not None]))
    summary.update(_stats("tpot_ms", [t for r in ok if (t := r.tpot) is not None]))
    summary.update(_stats("itl_ms", [x for r in ok for x in r.itls]))
    summary.update(_stats("e2e_ms", [r.e2e for r in ok]))
    summary["request_throughput"] = round(len(ok) / duration, 4)
    summary["output_throughput"] = round(sum(r.output_tokens for r in ok) / duration, 3)
    good = [r for r in records if meets(r, slo or {})]
    summary["goodput"] = round(len(good) / duration, 4)
    summary["good"] = len(good)
    summary["slo_attainment"] = round(len(good) / len(records), 4) if records else 0.0
    summary["completed"] = len(ok)
    summary["failed"] = len(records) - len(ok)
    summary["resumed"] = sum(r.resumed > 0 for r in records)  # streams that changed gateway
    summary["duration_s"] = round(duration, 3)
    lags = [lag for r in records if (lag := r.send_lag) is not None]
    if lags:  # open loop: how late the client sent (0 on a host that keeps up)
        summary.update(_stats("send_lag_ms", lags))
    return summary
