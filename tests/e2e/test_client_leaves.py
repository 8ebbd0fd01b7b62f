"""A resumable stream outlives its client's connection, not only its gateway (docs/
architecture.md, "Several gateways"): when a client of a `pdserve-resumable: 1` stream drops
its connection to a gateway that lives on, the gateway lets go of the stream (`Release`) and
its node keeps it as an orphan for `--orphan-grace`; the client resumes at any gateway, the
same one included, and the text goes on exactly. Real gateway and node processes; the sim
engine's tokens are a pure function of (seed, position), so every text is known here."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import orjson
import pytest

from pdserve.loadgen.resumable import sse_events
from tests.e2e.conftest import start_cluster, wait_for
from tests.e2e.streams import seeded_bodies, sim_text, stopped_half_way


def _held(cluster, at: str) -> float:
    return cluster.metric("pdserve:num_requests_running", at) + cluster.metric(
        "pdserve:num_requests_waiting", at
    )


async def _read(resp: aiohttp.ClientResponse, upto: int | None) -> tuple[str, str, str, bool]:
    """Text, stream id and last event id read from `resp` until the events cover `upto`
    output tokens (None: to the end); the last item says whether the stream ended ([DONE]).
    Counted in tokens (the event id), not events: a client that reads slowly gets several
    tokens per event (gateway/requests.py), so a count of events says nothing of how far
    into its stream a client leaves. A stream that is not resumable has no ids: its events
    are counted."""
    text, stream_id, last_id, covered = "", "", "0", 0
    async for event_id, payload in sse_events(resp.content):
        if payload == b"[DONE]":
            return text, stream_id, last_id, True
        chunk = orjson.loads(payload)
        stream_id = stream_id or chunk["id"]
        last_id = event_id if event_id is not None else last_id
        # an event after the text is named in its id (12.finish): its count first
        covered = int(event_id.partition(".")[0]) if event_id is not None else covered + 1
        text += "".join(c.get("text") or "" for c in chunk["choices"])
        if upto is not None and covered >= upto:
            return text, stream_id, last_id, False
    raise AssertionError("the stream ended without [DONE]")


async def _leave_and_resume(
    session, start: str, resume_at: str, body: dict, upto: int
) -> tuple[str, bool]:
    """The stream through `start`, its connection closed after `upto` tokens while that
    gateway lives, then resumed at `resume_at`: its whole text, and whether it was resumed
    (not when it ended within those tokens)."""
    headers = {"Content-Type": "application/json", "pdserve-resumable": "1"}
    async with session.post(f"{start}/v1/completions", data=orjson.dumps(body),
                            headers=headers) as resp:  # fmt: skip
        assert resp.status == 200, await resp.text()
        text, stream_id, last_id, done = await _read(resp, upto)
        resp.close()  # the client leaves; the gateway lives on
    if done:
        return text, False
    for _ in range(40):  # 409 while the node has not read the Release yet: ask again
        async with session.get(f"{resume_at}/v1/streams/{stream_id}",
                               headers={"Last-Event-ID": last_id}) as resp:  # fmt: skip
            if resp.status == 409:
                await asyncio.sleep(0.25)
                continue
            assert resp.status == 200, (resp.status, await resp.text())
            rest, _, _, done = await _read(resp, None)
            assert done
            return text + rest, True
    raise AssertionError(f"{stream_id} was never resumable at {resume_at}")


async def _many(
    urls: list[str], bodies: list[dict], leave_after: list[int]
) -> list[tuple[str, bool]]:
    timeout = aiohttp.ClientTimeout(total=180)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:  # fmt: skip
        return await asyncio.gather(*(
            _leave_and_resume(session, urls[i % 2], urls[(i + 1) % 2], body, leave_after[i])
            for i, body in enumerate(bodies)
        ))  # fmt: skip


def _outcome(cluster, url: str, outcome: str) -> float:
    return cluster.metric("pdserve:requests_total", url, outcome=outcome)


def _adopted(cluster, url: str) -> float:
    return cluster.metric("pdserve:stream_resumes_total", url, outcome="adopted")


def _counts(cluster, url: str) -> list[float]:
    """Streams let go at `url` (its clients left), adopted there, and placed again."""
    replaced = cluster.metric("pdserve:request_replacements_total", url)
    return [_outcome(cluster, url, "detached"), _adopted(cluster, url), replaced]


# Each class's tests share one cluster, stopped as the class ends, and count what they add.
SHORT_GRACE = 4.0


@pytest.fixture(scope="class")
def short_grace():
    """1P1D and two gateways (a resume of an unknown stream answered within 2 s); an
    orphan kept 4 s: the tests that see the grace end."""
    cluster = start_cluster(
        prefill=1, decode=1, engine="sim", gateways=2, gateway_flags=("--resume-timeout", "2"),
        node_flags=("--sim-time-scale", "1", "--orphan-grace", str(SHORT_GRACE)),
    )  # fmt: skip
    yield cluster
    cluster.stop()


@pytest.fixture(scope="class")
def long_grace():
    """2P2D and two gateways; an orphan kept 30 s. --drain-timeout 1: the ended orphans are
    kept for the grace, which a node stopped at teardown would wait out (past the 10 s it is
    given), so it hands them back after 1 s."""
    cluster = start_cluster(
        prefill=2, decode=2, engine="sim", gateways=2,
        node_flags=("--sim-time-scale", "0.6", "--kv-backend", "tcp", "--max-batch", "8",
                    "--orphan-grace", "30", "--drain-timeout", "1"),
    )  # fmt: skip
    yield cluster
    cluster.stop()


def _one_gateway_resumes_its_own_stream_and_frees_one_never_resumed(cluster, tokenizer):
    """One gateway: a client that left resumes at the same gateway with the exact text; a
    client that never comes back leaves its stream on the node until `--orphan-grace` ends,
    then it is freed with its KV; a stream that did not ask to be resumable is freed at once."""
    url = cluster.urls[0]
    detached = cluster.metric("pdserve:requests_total", url, outcome="detached")
    cancelled = cluster.metric("pdserve:requests_total", url, outcome="cancelled")
    body, lost, plain = seeded_bodies(3, 3000)  # ~30 s of decoding each: none ends here

    async def run() -> str:
        async with aiohttp.ClientSession() as session:
            text, resumed = await _leave_and_resume(session, url, url,
                                                    {**body, "max_tokens": 60}, 5)  # fmt: skip
            assert resumed
            headers = {"Content-Type": "application/json", "pdserve-resumable": "1"}
            async with session.post(f"{url}/v1/completions", data=orjson.dumps(lost),
                                    headers=headers) as resp:  # fmt: skip
                _, lost_id, _, _ = await _read(resp, 5)
                resp.close()
            assert wait_for(lambda: _held(cluster, url) == 1, 10)  # kept for a resume
            # its id with a %0A passed the id check ($ before a final newline): adopted, then
            # a 500 writing the id into a header; HEAD ran a whole resume into no body
            for method, path in (("GET", f"{lost_id}%0A"), ("HEAD", lost_id)):
                async with session.request(method, f"{url}/v1/streams/{path}",
                                           headers={"Last-Event-ID": "0"}) as resp:  # fmt: skip
                    assert 400 <= resp.status < 500, (method, resp.status)
            async with session.post(f"{url}/v1/completions", data=orjson.dumps(plain)) as resp:
                await _read(resp, 5)
                resp.close()
            return text

    text = asyncio.run(run())
    assert text == sim_text(tokenizer, body["prompt"], body["seed"], 60)
    assert cluster.metric("pdserve:requests_total", url, outcome="detached") == detached + 2
    # the plain one's client left: the gateway sees it go at its next write or at once
    assert wait_for(
        lambda: cluster.metric("pdserve:requests_total", url, outcome="cancelled") == cancelled + 1,
        10,
    )
    # the plain one freed at once, the lost one at the grace's end (3 or 4 s): well before
    # its ~30 s of decoding would have ended it
    assert wait_for(lambda: _held(cluster, url) == 0, 10)
    assert wait_for(lambda: cluster.metric("pdserve:kv_blocks", url, state="in_use") == 0, 10)


def test_one_gateway_resumes_its_own_stream_and_frees_one_never_resumed_colocated(
    make_cluster, tokenizer
):
    cluster = make_cluster(
        prefill=0, decode=0, colocated=1, engine="sim",
        node_flags=("--sim-time-scale", "1", "--orphan-grace", "3"),
    )  # fmt: skip
    _one_gateway_resumes_its_own_stream_and_frees_one_never_resumed(cluster, tokenizer)


class TestShortGrace:
    def test_a_stream_that_ended_unread_is_resumed_at_any_gateway_until_the_grace_ends(
        self, short_grace, tokenizer
    ):
        """A client stops reading (its connection dead, or its host gone, no FIN) and its stream
        ends: the gateway wrote every chunk into the connection's buffers and finished it, the
        client has only the first few. The node kept the ended stream (its gateway let it go at
        its end): the client resumes at the other gateway with the exact rest, again from the
        start at the first one, and once the grace is over the stream is gone (404). A stream
        that ends at its first token is kept by its prefill node the same way, and one ended
        by a stop string at its gateway is ended on its node there and kept too."""
        grace = SHORT_GRACE
        cluster = short_grace
        first, second = cluster.urls
        ok = {url: _outcome(cluster, url, "ok") for url in cluster.urls}
        adopted = {url: _adopted(cluster, url) for url in cluster.urls}
        (body,) = seeded_bodies(1, 40)  # ~0.4 s of decoding
        whole = sim_text(tokenizer, body["prompt"], body["seed"], 40)
        headers = {"Content-Type": "application/json", "pdserve-resumable": "1"}

        def ended() -> bool:
            return _outcome(cluster, first, "ok") == ok[first] + 1

        async def resume(session, url: str, stream_id: str, last_id: str) -> tuple[int, str]:
            async with session.get(f"{url}/v1/streams/{stream_id}",
                                   headers={"Last-Event-ID": last_id}) as resp:  # fmt: skip
                if resp.status != 200:
                    return resp.status, await resp.text()
                rest, _, _, done = await _read(resp, None)
                assert done
                return 200, rest

        async def run() -> None:
            async with aiohttp.ClientSession() as session:
                resp = await session.post(f"{first}/v1/completions", data=orjson.dumps(body),
                                          headers=headers)  # fmt: skip
                text, stream_id, last_id, done = await _read(resp, 3)
                assert not done
                # not read any more: the stream ends at the node and at its gateway
                assert await asyncio.to_thread(wait_for, ended, 10)
                assert await resume(session, second, stream_id, last_id) == (
                    200,
                    whole[len(text) :],
                )
                assert await resume(session, first, stream_id, "0") == (200, whole)
                resp.close()
                # a replay is a resume (stream_resumes_total), not a request done again
                for url, done in ((first, 1), (second, 0)):
                    assert _outcome(cluster, url, "ok") == ok[url] + done
                    assert _adopted(cluster, url) == adopted[url] + 1
                # one that ends at its first token ends on the prefill node: kept there too
                one = {**body, "max_tokens": 1}
                async with session.post(f"{first}/v1/completions", data=orjson.dumps(one),
                                        headers=headers) as short:  # fmt: skip
                    token, short_id, _, done = await _read(short, None)
                assert done and token == sim_text(tokenizer, body["prompt"], body["seed"], 1)
                assert await resume(session, second, short_id, "0") == (200, token)
                # one ended by a stop string at its gateway is ended on its node at that token
                # (its KV freed: 2,000 tokens would decode for 20 s) and kept for a resume too
                stop = whole[len(whole) // 2 :][:4]
                stopped = {**body, "max_tokens": 2000, "stop": [stop]}
                async with session.post(f"{first}/v1/completions", data=orjson.dumps(stopped),
                                        headers=headers) as cut:  # fmt: skip
                    text, cut_id, _, done = await _read(cut, None)
                assert done and text == whole[: whole.index(stop)]
                assert await asyncio.to_thread(wait_for, lambda: _held(cluster, first) == 0, 10)
                assert await resume(session, second, cut_id, "0") == (200, text)
                # each resume's end let it go again: the grace counts from the last one's end
                await asyncio.sleep(grace + 1.0)  # + the nodes' expiry pass (each heartbeat)
                status, reply = await resume(session, second, stream_id, "0")
                assert status == 404, reply

        asyncio.run(run())
        for url in cluster.urls:
            assert wait_for(lambda url=url: _held(cluster, url) == 0, 10)

    def test_one_gateway_resumes_its_own_stream_and_frees_one_never_resumed(
        self, short_grace, tokenizer
    ):
        """The first of the two gateways (1P1D)."""
        _one_gateway_resumes_its_own_stream_and_frees_one_never_resumed(short_grace, tokenizer)


class TestLongGrace:
    def test_two_hundred_clients_leave_live_gateways_and_resume_at_the_other(
        self, long_grace, tokenizer
    ):
        """200 resumable streams over two gateways; each client drops its connection after 1
        to 40 tokens (seeded) and resumes at the other gateway; a quarter end at a stop string
        half way (the orphan decodes on past it: the resume ends it there): every text is
        exact, each gateway let go of what its clients left and adopted what the other's did,
        nothing was re-placed (the nodes decoded on), and nothing is held afterwards."""
        cluster = long_grace
        counts = {url: _counts(cluster, url) for url in cluster.urls}
        # 200 tokens, ~1 s of decoding at this scale: a client that leaves after at most 40
        # tokens leaves a running stream unless its reads fell ~1 s behind
        bodies = seeded_bodies(200, 200)
        rng = random.Random(7)
        leave_after = [rng.randint(1, 40) for _ in bodies]  # 1: often before its KV is delivered
        expected = [sim_text(tokenizer, b["prompt"], b["seed"], b["max_tokens"]) for b in bodies]
        for i in range(0, len(bodies), 4):  # a stop string past 200 tokens: its client left
            bodies[i]["max_tokens"] = 400  # before it however slowly it read (as above)
            whole = sim_text(tokenizer, bodies[i]["prompt"], bodies[i]["seed"], 400)
            expected[i], bodies[i]["stop"] = stopped_half_way(whole)
        got = asyncio.run(_many(cluster.urls, bodies, leave_after))
        assert [text for text, _ in got] == expected
        assert all(resumed for _, resumed in got)
        for url in cluster.urls:
            # every stream left at one gateway (a live one) and was adopted at the other, none
            # re-placed
            added = [
                now - then for now, then in zip(_counts(cluster, url), counts[url], strict=True)
            ]
            assert added == [100, 100, 0], (url, added)
        for url in cluster.urls:
            assert wait_for(lambda url=url: _held(cluster, url) == 0, 10)
            assert wait_for(
                lambda url=url: cluster.metric("pdserve:kv_blocks", url, state="in_use") == 0, 10
            )

    def test_a_stream_that_ended_while_its_client_was_away_is_resumed_whole(
        self, long_grace, tokenizer
    ):
        """The client comes back after its stream has ended on the node and several heartbeats
        (and owner sweeps) have passed: the ended orphan's tokens were kept for the grace, the
        resume gets the rest of the text and the end, and nothing is held after."""
        cluster = long_grace
        url = cluster.urls[0]
        generated = cluster.metric("pdserve:generation_tokens_total", url)
        (body,) = seeded_bodies(1, 40)  # ~0.25 s of decoding
        headers = {"Content-Type": "application/json", "pdserve-resumable": "1"}

        async def run() -> str:
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{url}/v1/completions", data=orjson.dumps(body),
                                        headers=headers) as resp:  # fmt: skip
                    text, stream_id, last_id, done = await _read(resp, 3)
                    resp.close()
                assert not done
                # it ends on the node as an orphan (nothing running), then 10 heartbeats (0.2 s)
                assert await asyncio.to_thread(
                    wait_for, lambda: cluster.metric("pdserve:num_requests_running", url) == 0, 10
                )
                await asyncio.sleep(2.0)
                async with session.get(f"{url}/v1/streams/{stream_id}",
                                       headers={"Last-Event-ID": last_id}) as resp:  # fmt: skip
                    assert resp.status == 200, await resp.text()
                    rest, _, _, done = await _read(resp, None)
                assert done
                return text + rest

        assert asyncio.run(run()) == sim_text(tokenizer, body["prompt"], body["seed"], 40)
        assert wait_for(lambda: _held(cluster, url) == 0, 10)
        # the tokens made while it was an orphan count where they were streamed (none did);
        # those streamed before its client left but not read may count twice (at most 40 more)
        assert 40 <= cluster.metric("pdserve:generation_tokens_total", url) - generated <= 80
