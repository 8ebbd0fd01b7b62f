"""A flood of resumes costs the cluster little and changes nothing (docs/architecture.md,
"Several gateways"): a gateway asks the nodes for every stream being resumed in one message
per node per round, whatever their number, and looks for at most `--max-resuming` at once;
past that a resume gets 429 with Retry-After at once. A real stream resumed amid hundreds of
resumes for streams that do not exist goes on exactly. Real gateway and node processes."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import orjson

from tests.e2e.conftest import wait_for
from tests.e2e.streams import seeded_bodies, sim_text
from tests.e2e.test_client_leaves import _held, _read

BOGUS = 400
LIMIT = 64
TIMEOUT_S = 6.0  # the gateway's --resume-timeout here (the refusals' bound: see below)
GAP_S = 0.02  # gateway/resume.py: rounds go out at most this often


async def _bogus(session: aiohttp.ClientSession, url: str, i: int) -> tuple[int, str, float]:
    stream_id = "cmpl-" + random.Random(i).randbytes(12).hex()  # no node holds it
    start = time.monotonic()
    async with session.get(f"{url}/v1/streams/{stream_id}",
                           headers={"Last-Event-ID": str(i % 7)}) as resp:  # fmt: skip
        body = await resp.json()
        assert body["error"]["message"], body
        seconds = time.monotonic() - start
        return resp.status, resp.headers.get("Retry-After", ""), seconds


async def _resume(session: aiohttp.ClientSession, url: str, stream_id: str, last_id: str
                  ) -> tuple[str, int]:  # fmt: skip
    """The rest of the stream, and how many 429s it got first (the flood fills the room)."""
    busy = 0
    for _ in range(60):
        async with session.get(f"{url}/v1/streams/{stream_id}",
                               headers={"Last-Event-ID": last_id}) as resp:  # fmt: skip
            if resp.status in (409, 429):  # the Release unread yet; room full
                busy += resp.status == 429
                await asyncio.sleep(float(resp.headers.get("Retry-After", "0.25")))
                continue
            assert resp.status == 200, (resp.status, await resp.text())
            rest, _, _, done = await _read(resp, None)
            assert done
            return rest, busy
    raise AssertionError(f"{stream_id} was never resumed")


def test_a_flood_of_resumes_is_bounded_and_a_real_resume_amid_it_goes_on_exactly(
    make_cluster, tokenizer
):
    cluster = make_cluster(
        prefill=1, decode=1, engine="sim",
        gateway_flags=("--max-resuming", str(LIMIT), "--resume-timeout", str(TIMEOUT_S)),
        node_flags=("--sim-time-scale", "1", "--orphan-grace", "30"),
    )  # fmt: skip
    url = cluster.urls[0]
    (body,) = seeded_bodies(1, 600)
    headers = {"Content-Type": "application/json", "pdserve-resumable": "1"}

    async def run() -> tuple[str, int, list[tuple[int, str, float]], float]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async with session.post(f"{url}/v1/completions", data=orjson.dumps(body),
                                    headers=headers) as resp:  # fmt: skip
                assert resp.status == 200, await resp.text()
                text, stream_id, last_id, done = await _read(resp, 5)
                resp.close()  # the client leaves; the stream decodes on as an orphan
            assert not done
            start = time.monotonic()
            flood = [asyncio.create_task(_bogus(session, url, i)) for i in range(BOGUS)]
            while not any(task.done() for task in flood):  # the first 429: the room is full
                await asyncio.sleep(0.01)
            rest, busy = await _resume(session, url, stream_id, last_id)
            bogus = await asyncio.gather(*flood)
            return text + rest, busy, bogus, time.monotonic() - start

    rounds_before = cluster.metric("pdserve:stream_resume_rounds_total", url)
    text, busy, bogus, elapsed = asyncio.run(run())
    rounds = cluster.metric("pdserve:stream_resume_rounds_total", url) - rounds_before

    assert text == sim_text(tokenizer, body["prompt"], body["seed"], 600)  # nothing lost
    assert busy >= 1  # it came while the room was full: refused, then served
    statuses = [status for status, _, _ in bogus]
    assert set(statuses) <= {404, 429}, statuses
    limited = [(retry, s) for status, retry, s in bogus if status == 429]
    looked = statuses.count(404)
    # all but the first LIMIT arrive while those are looked for (3 s): at once refused
    assert len(limited) >= BOGUS - 2 * LIMIT and looked >= LIMIT, (len(limited), looked)
    # refused without a look: one that waited for the looks ahead of it would take at least
    # TIMEOUT_S. The rest is opening 400 connections on 2 vCPUs: at most 0.10 s idle, 0.21 s
    # beside 3 busy processes, 1.13 s beside 8 (a Zen 4); 0.4 to over 1 s in one CI run (a
    # loaded host, or SYNs dropped at the gateway's accept queue, 128 long then: 1 s to the
    # retransmit); 3.46 s once with two test workers on a 2-vCPU Xeon whose CPU a cgroup
    # quota halved, when the timeout was 3 s. So the bound is the analysis's, not a multiple
    # of an idle figure, and the timeout is long enough to leave it room
    slowest = max(s for _, s in limited)
    assert all(int(retry) >= 1 for retry, _ in limited) and slowest < TIMEOUT_S, slowest
    assert all(s >= TIMEOUT_S for status, _, s in bogus if status == 404)  # they did look
    assert cluster.metric("pdserve:stream_resumes_total", url, outcome="busy") == (
        len(limited) + busy
    )
    # rounds: one Adopt per node each, however many streams are looked for. Asked one by
    # one, every stream looked for would cost a message per node every 250 ms, looked x 12
    # here (768); rounds go out at most every GAP_S whatever the flood, and streams asked
    # apart share them (49 here on a 2-vCPU AMD EPYC Zen 4: the arrivals' spread)
    assert rounds <= elapsed / GAP_S + 1, (rounds, elapsed)
    assert rounds < looked * (TIMEOUT_S / 0.25) / 4, (rounds, looked)
    status, _ = cluster.get("/health")
    assert status == 200
    assert wait_for(lambda: _held(cluster, url) == 0, 10)  # the real stream ended and left
    assert wait_for(lambda: cluster.metric("pdserve:kv_blocks", url, state="in_use") == 0, 10)
