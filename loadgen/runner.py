"""Run a workload against a URL and write its results.

Open loop (arrival offsets from the workload) or closed loop (`concurrency` requests in
flight, each starting when one ends). The first `warmup` requests run before the measured
ones and are excluded. Output folder: requests.jsonl (one line per request), summary.json,
summary.md; a live progress bar shows completed and failed counts.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.loadgen.client import send
from pdserve.loadgen.metrics import RequestRecord
from pdserve.loadgen.workloads import RequestSpec


@dataclass
class BenchConfig:
    # several gateways: comma-separated; request i goes to the i-th (mod their count), its
    # stream resumable on the others (loadgen/resumable.py)
    url: str
    model: str | None = None
    concurrency: int = 0  # 0: open loop by arrival times
    warmup: int = 0
    ignore_eos: bool = True
    timeout: float = 600.0
    progress: bool = True
    endpoint: str = "completions"  # or "chat" (text prompts as one user message)
    # a new connection per request: llama.cpp's server closes keep-alive connections a client
    # must not reuse (a reused one fails the request)
    fresh_connections: bool = False
    # closed loop: stream k sends its first request k x stagger seconds after stream 0, so
    # that prompts keep arriving while others decode (0: every stream starts at once, and
    # equal requests then run in lock-step waves)
    stagger: float = 0.0
    # several gateways: streams resumable on the others (False: plain streams, as one
    # gateway's are: a study comparing gateway counts runs one client path in every row)
    resumable: bool = True


async def _send(
    session: aiohttp.ClientSession, cfg: BenchConfig, spec: RequestSpec, index: int
) -> RequestRecord:
    urls = [u.strip().rstrip("/") for u in cfg.url.split(",") if u.strip()]
    turn = abs(index) % len(urls)
    url, others = urls[turn], urls[turn + 1 :] + urls[:turn]  # resumed on the others
    resume = others if cfg.resumable and others else None
    return await send(session, url, cfg.model, spec, index, cfg.ignore_eos, cfg.timeout,
                      cfg.endpoint, others=resume)  # fmt: skip


async def run(specs: list[RequestSpec], cfg: BenchConfig) -> list[RequestRecord]:
    """Records of the measured (post-warm-up) requests, in workload order."""
    connector = aiohttp.TCPConnector(limit=0, force_close=cfg.fresh_connections)
    async with aiohttp.ClientSession(connector=connector) as session:
        for i, spec in enumerate(specs[: cfg.warmup]):
            await _send(session, cfg, spec, -1 - i)
        measured = specs[cfg.warmup :]
        progress = _Progress(len(measured), cfg.progress)
        if cfg.concurrency:
            records = await _closed_loop(session, measured, cfg, progress)
        else:
            records = await _open_loop(session, measured, cfg, progress)
        progress.close()
    return sorted(records, key=lambda r: r.index)


async def _open_loop(
    session: aiohttp.ClientSession, specs: list[RequestSpec], cfg: BenchConfig, progress: _Progress
) -> list[RequestRecord]:
    start = time.monotonic()
    base = specs[0].arrival if specs else 0.0

    async def one(i: int, spec: RequestSpec) -> RequestRecord:
        due = start + spec.arrival - base
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        record = await _send(session, cfg, spec, i)
        record.scheduled = due  # its send lag: how far the client fell behind the arrivals
        progress.update(record)
        return record

    return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(specs))))


async def _closed_loop(
    session: aiohttp.ClientSession, specs: list[RequestSpec], cfg: BenchConfig, progress: _Progress
) -> list[RequestRecord]:
    queue = list(enumerate(specs))[::-1]
    records: list[RequestRecord] = []

    async def worker(k: int) -> None:
        await asyncio.sleep(k * cfg.stagger)
        while queue:
            i, spec = queue.pop()
            record = await _send(session, cfg, spec, i)
            progress.update(record)
            records.append(record)

    await asyncio.gather(*(worker(k) for k in range(cfg.concurrency)))
    return records


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.done = self.failed = 0
        self.bar: Any = None
        if enabled:
            from rich.progress import Progress

            self.bar = Progress(transient=True)
            self.bar.start()
            self.task = self.bar.add_task("requests", total=total)

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        self.failed += not record.ok
        if self.bar is not None:
            self.bar.update(
                self.task,
                advance=1,
                description=f"completed {self.done - self.failed} failed {self.failed}",
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def write_results(
    out: Path, records: list[RequestRecord], summary: dict[str, Any], meta: dict[str, Any]
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "requests.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r.to_json()) + "\n")
    (out / "summary.json").write_text(json.dumps({**meta, **summary}, indent=2) + "\n")
    rows = [f"| {k} | {v} |" for k, v in summary.items()]
    (out / "summary.md").write_text("| metric | value |\n|---|---|\n" + "\n".join(rows) + "\n")
