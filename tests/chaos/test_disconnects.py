"""Clients that go away at random points (before placement, during prefill, during the KV
handoff, mid-stream, after the last token) while hundreds of others stream: every node frees
every block, the gateway's request table empties, and the requests that stayed get exact text."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import orjson

from tests.e2e.conftest import wait_for
from tests.e2e.streams import sim_text


async def _one(session: aiohttp.ClientSession, url: str, body: dict, cut: float | int | None):
    """`cut`: None reads to the end; a float leaves after that many seconds; an int after
    that many content chunks. Returns the text read by a client that stayed, else None."""
    text = ""

    async def read() -> str:
        nonlocal text
        async with session.post(url + "/v1/completions", data=orjson.dumps(body)) as resp:
            assert resp.status == 200, await resp.text()
            chunks = 0
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                choice = orjson.loads(line[6:])["choices"][0]
                text += choice["text"]
                chunks += bool(choice["text"])
                if isinstance(cut, int) and chunks >= cut:
                    return ""  # leaving: the context manager closes the connection
        return text

    if isinstance(cut, float):
        try:
            await asyncio.wait_for(read(), cut)
        except asyncio.TimeoutError:
            return None
        return None
    got = await read()
    return got if cut is None else None


def test_clients_leaving_at_random_points_leak_nothing(make_cluster, tokenizer, chaos_scale):
    cluster = make_cluster(
        prefill=2,
        decode=2,
        engine="sim",
        node_flags=("--sim-time-scale", "0.2", "--kv-backend", "tcp"),
    )
    rng = random.Random(17)
    n = 240 * chaos_scale
    bodies = [
        {"prompt": list(range(1000 + 11 * i, 1200 + 11 * i + i % 300)), "max_tokens": 30,
         "seed": i, "temperature": 1.0, "ignore_eos": True, "stream": True}
        for i in range(n)
    ]  # fmt: skip
    cuts: list[float | int | None] = [
        rng.choice([None, rng.uniform(0.0, 1.5), rng.randint(1, 29)]) for _ in range(n)
    ]

    async def main() -> list[str | None]:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
        ) as session:
            return await asyncio.gather(
                *(_one(session, cluster.url, b, c) for b, c in zip(bodies, cuts, strict=True))
            )

    texts = asyncio.run(main())
    stayed = [(b, t) for b, t, c in zip(bodies, texts, cuts, strict=True) if c is None]
    assert len(stayed) > n // 5
    for body, text in stayed:
        assert text == sim_text(tokenizer, body["prompt"], body["seed"], 30)
    left = n - len(stayed)
    assert wait_for(lambda: cluster.metric("pdserve:kv_blocks", state="in_use") == 0, 15), (
        f"{cluster.metric('pdserve:kv_blocks', state='in_use')} blocks still in use"
    )
    assert wait_for(lambda: cluster.metric("pdserve:gateway_attempts_in_flight") == 0, 8)
    print(f"\ndisconnects: {left} of {n} clients left early, 0 blocks leaked")
