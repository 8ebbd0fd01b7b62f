"""What the gateway makes of the nodes' answers to its rounds of `Adopt` (gateway/resume.py):
a stream handed over but not served is let go again, the latest attempt is the one resumed,
one given back is placed again, a stream still in prefill or held by a registering node is
a 409 to retry, a malformed answer a 502; the rebuilt stream is written as its first gateway
wrote it (its request's output options), from the client's position, an event after the
text included."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.protocol import REGISTERING, Adopt, Adopted
from pdserve.gateway.openai_api import ApiError
from pdserve.gateway.resume import ROUND_S
from pdserve.gateway.stream_state import Position, StreamFormat
from tests.unit.test_resume_rounds import ID, _Link, _resumes, _until


def _found(rid: str, outputs: tuple[int, ...] = (7, 8)) -> Adopted:
    return Adopted(request_id=f"{rid}.0", found=True, prompt_ids=[5, 6], output_ids=[*outputs],
                   base=0, params=SamplingParams(max_tokens=4, temperature=0.0))  # fmt: skip


async def test_a_stream_adopted_but_not_served_is_let_go_again(tokenizer):
    """The node hands a stream over (it is this gateway's from then on) but the resume
    does not serve it: the answer came after the resume gave up, or the client's position
    is not one a chunk ended at. The gateway lets it go again (`Release`), so the node
    keeps it for the client's next resume instead of losing it; a late copy of the
    answer for a stream served here lets nothing go."""
    link, let_go = _Link(), list[tuple[str, str]]()
    resumes, table = _resumes(tokenizer, link, let_go)
    task = asyncio.create_task(resumes.resume(f"cmpl-{ID}", Position(0), False))
    await _until(lambda: link.asked(ID) >= 1)
    task.cancel()  # the client left while its stream was looked for
    with pytest.raises(asyncio.CancelledError):
        await task
    resumes.answered(b"d0", _found(ID))
    assert let_go == [(f"{ID}.0", "d0")]
    let_go.clear()
    bad = asyncio.create_task(resumes.resume(f"cmpl-{ID}", Position(1), False))
    await asyncio.sleep(0)  # it asks from now on (the first resume's rounds are over)
    asked = link.asked(ID)
    await _until(lambda: link.asked(ID) > asked)
    smile = tuple(tokenizer.encode("\U0001f642", add_special_tokens=False))
    assert len(smile) == 2  # the emoji's bytes in two tokens: no chunk ends after the first
    resumes.answered(b"d0", _found(ID, smile))
    with pytest.raises(ApiError) as err:
        await bad
    assert err.value.status == 409 and let_go == [(f"{ID}.0", "d0")]
    served = asyncio.create_task(resumes.resume(f"cmpl-{ID}", Position(0), False))
    await asyncio.sleep(0)
    asked = link.asked(ID)
    await _until(lambda: link.asked(ID) > asked)
    resumes.answered(b"d0", _found(ID))
    req, _, _ = await served
    assert table.get(f"{ID}.0") is not None and not req.finished
    let_go.clear()
    resumes.answered(b"d0", _found(ID))  # a late copy (asked twice): it is served here
    assert let_go == []
    table.close(f"{ID}.0")  # placed again: attempt 1 is served here, attempt 0 forgotten
    req.attempt = 1
    table.open(req, 4)
    resumes.answered(b"d0", _found(ID))  # a very late copy for attempt 0: nothing let go
    assert let_go == []


async def test_a_stream_that_decoded_past_its_stop_string_ends_at_it_when_resumed(tokenizer):
    """An orphan decodes on past its stop string (stop strings are the gateway's): its
    resume replays up to the stop and no further, the request finished there with that
    many output tokens (usage), not the node's count."""
    link = _Link()
    resumes, table = _resumes(tokenizer, link)
    words = tokenizer.encode(" one two three four five", add_special_tokens=False)
    task = asyncio.create_task(resumes.resume(f"cmpl-{ID}", Position(0), False))
    await _until(lambda: link.asked(ID) >= 1)
    params = SamplingParams(max_tokens=9, temperature=0.0, stop=(" three",))
    resumes.answered(b"d0", Adopted(request_id=f"{ID}.0", found=True, prompt_ids=[5, 6],
                                    output_ids=words, base=0, params=params))  # fmt: skip
    req, _, _ = await task
    assert req.finished and req.ended_before is False
    assert tokenizer.decode(req.output_ids) == " one two three" and len(words) > 3
    assert table.get(f"{ID}.0") is None  # over: nothing opened for it


async def test_a_stream_still_in_prefill_is_a_409_to_retry_not_a_404(tokenizer):
    """A node holds the stream but has not made this attempt's first token (common/node/
    adoption.py answers "in prefill"): a node has it, so not the final 404 the client's
    helper gives up on; a 409, retried (loadgen/resumable.py) until it is adoptable."""
    link = _Link()
    resumes, _ = _resumes(tokenizer, link)
    resumes.timeout = 0.3
    task = asyncio.create_task(resumes.resume(f"cmpl-{ID}", Position(0), False))
    await _until(lambda: link.asked(ID) >= 1)
    resumes.answered(b"d0", Adopted(request_id=ID, found=False, reason="in prefill"))
    with pytest.raises(ApiError) as err:
        await task
    assert err.value.status == 409 and "prefilled" in err.value.message


async def test_an_answer_the_resume_was_cancelled_before_reading_is_let_go(tokenizer):
    """The node's answer (the stream now ours) is in, but the client leaves before the
    resume reads it (aiohttp cancels the handler): the stream is let go again, not left to
    our lease to free as stale."""
    link, let_go = _Link(), list[tuple[str, str]]()
    resumes, table = _resumes(tokenizer, link, let_go)
    task = asyncio.create_task(resumes.resume(f"cmpl-{ID}", Position(0), False))
    await _until(lambda: link.asked(ID) >= 1)
    task.cancel()  # the client left; in the same turn of the loop the answer is read
    resumes.answered(b"d0", _found(ID))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert let_go == [(f"{ID}.0", "d0")] and table.get(f"{ID}.0") is None


async def test_a_stream_given_back_before_its_adoption_was_read_is_placed_again(tokenizer):
    """The node hands the stream over, then preempts it: its `Preempted` (tokens socket) is
    read before the `Adopted` (control socket), when the table does not know it yet. It is
    kept, and the resume says so, for the stream to be placed again at once (else its
    attempt waits on a node that holds nothing)."""
    link = _Link()
    resumes, table = _resumes(tokenizer, link)
    task = asyncio.create_task(resumes.resume(f"cmpl-{ID}", Position(0), False))
    await _until(lambda: link.asked(ID) >= 1)
    resumes.preempted(f"{ID}.0", "d0", "KV cache full")
    resumes.preempted(f"{ID}.0", "d9", "another node's")  # not the adopting node's
    resumes.answered(b"d0", _found(ID))
    req, _, gave_back = await task
    assert gave_back == "KV cache full" and table.current(req) is not None


async def test_a_stream_its_node_gave_back_while_orphaned_is_rebuilt_and_placed_again(tokenizer):
    """A decode node preempted an orphan (no gateway to tell): it keeps its tokens as an
    ended orphan of reason "preempted" (common/node/runtime.py `give_back`). Its adopter
    rebuilds it unfinished, with every token, and is told to place it again (a finish
    reason "preempted" would have reached the client)."""
    link = _Link()
    resumes, table = _resumes(tokenizer, link)
    task = asyncio.create_task(resumes.resume(f"cmpl-{ID}", Position(0), False))
    await _until(lambda: link.asked(ID) >= 1)
    gave_back = msgspec.structs.replace(_found(ID), finish_reason="preempted")
    resumes.answered(b"d0", gave_back)
    req, _, back = await task
    assert back is not None and not req.finished and req.output_ids == [7, 8]
    assert table.current(req) is not None


async def test_a_stream_held_by_a_node_still_registering_here_is_a_409_to_retry(tokenizer):
    """The node answers that this gateway is registering with it again (silent to it for a
    while): the stream is there, adoptable once the registration is read; a client asking
    until the resume times out is told to retry (409), not that no node holds it (404)."""

    class Answering(_Link):  # the node's answer read with the round, however slow the host
        async def send(self, node, msg: Adopt) -> None:
            await super().send(node, msg)
            resumes.answered(b"d0", Adopted(request_id=ID, found=False, reason=REGISTERING))

    resumes, _ = _resumes(tokenizer, Answering(), timeout=0.5)
    with pytest.raises(ApiError) as err:
        await resumes.resume(f"cmpl-{ID}", Position(3), False)
    assert err.value.status == 409 and "registering" in err.value.message


@pytest.mark.parametrize("held", ["the stream is served by a live gateway", "in prefill"])
async def test_an_older_attempt_given_back_is_not_resumed_while_another_node_holds_it(
    tokenizer, held
):
    """d0 has attempt 0, given back; d1 holds the stream (its newer attempt) but cannot
    hand it over yet: its gateway not yet seen gone, or its recompute under way. Taking
    attempt 0 would place a second copy under attempt 1's id: the client gets a 409 to
    retry, and d0's stream is let go again for that retry."""
    link, let_go = _Link(), list[tuple[str, str]]()
    resumes, _ = _resumes(tokenizer, link, let_go, nodes=2, timeout=3 * ROUND_S)
    task = asyncio.create_task(resumes.resume(f"cmpl-{ID}", Position(0), False))
    await _until(lambda: link.asked(ID) >= 2)
    resumes.answered(b"d1", Adopted(request_id=ID, found=False, reason=held))
    resumes.answered(b"d0", msgspec.structs.replace(_found(ID), finish_reason="preempted"))
    with pytest.raises(ApiError) as err:
        await task
    assert err.value.status == 409 and let_go == [(f"{ID}.0", "d0")]


async def test_a_stream_given_back_found_just_before_the_deadline_is_resumed(tokenizer):
    """The only answer, one given back, comes in the last round before --resume-timeout:
    resumed, not a 404 "no node holds" (and let go) for waiting on other answers."""
    link = _Link()
    resumes, table = _resumes(tokenizer, link, timeout=ROUND_S / 5)
    task = asyncio.create_task(resumes.resume(f"cmpl-{ID}", Position(0), False))
    await _until(lambda: link.asked(ID) >= 1)
    resumes.answered(b"d0", msgspec.structs.replace(_found(ID), finish_reason="preempted"))
    req, _, gave_back = await task
    assert gave_back == "given back while orphaned" and table.current(req) is not None


@pytest.mark.parametrize("old", ["given back", "mispositioned"])
async def test_the_latest_attempt_is_resumed_not_an_older_one_on_another_node(tokenizer, old):
    """d0 still has attempt 0 of the stream (given back: its tokens kept; placed again since
    as attempt 1 on d1, which decodes on). Both answer a round, d0 first: attempt 1 is
    resumed. Attempt 0 taken would be placed again as a second attempt 1, and a client
    past attempt 0's tokens would get d0's refusal of its position, a 409."""
    link = _Link()
    resumes, table = _resumes(tokenizer, link, nodes=2)
    words = tuple(tokenizer.encode(" one two three four", add_special_tokens=False))
    assert len(words) == 4
    have = 2 if old == "given back" else 3
    task = asyncio.create_task(resumes.resume(f"cmpl-{ID}", Position(have), False))
    await _until(lambda: link.asked(ID) >= 2)
    if old == "given back":
        older = msgspec.structs.replace(_found(ID, words[:2]), finish_reason="preempted")
        resumes.answered(b"d0", older)
    else:
        resumes.answered(b"d0", Adopted(request_id=ID, found=False,
                                        reason="Last-Event-ID 3 is not a position"))  # fmt: skip
    await asyncio.sleep(ROUND_S / 5)  # d1 is busy: its answer comes a little later
    latest = msgspec.structs.replace(_found(ID, words), request_id=f"{ID}.1")
    resumes.answered(b"d1", latest)
    req, _, gave_back = await task
    assert req.attempt == 1 and req.ran_on == {"decode": "d1"} and gave_back is None
    assert table.get(f"{ID}.1") is not None and req.output_ids == list(words)


@pytest.mark.parametrize(
    "changes",
    [
        {"params": None},
        {"request_id": f"{ID}.\u00b2"},  # "2" superscript: isdigit, but no int
        {"request_id": f"{ID}.x"},
        {"output_ids": [7, 2**40]},
        {"prompt_ids": [5, -1]},
        {"prompt_ids": []},
        {"base": 3},  # more than its 2 tokens
        {"stream_format": b"\xc1"},  # not msgpack
    ],
)
async def test_a_malformed_adoption_ends_the_resume_with_a_502_and_keeps_nothing(
    tokenizer, changes
):
    """A node's Adopted that no stream can be rebuilt from (no params, a wire id with no
    attempt number, token ids a batch would not pass, a base past its tokens) raised in
    the resume (the client's 500, the stream handed over and lost) or was served as it
    was. It is dropped with a log line: the client gets a 502 with the reason, the stream
    is let go again to its node, and nothing is left in the table or the asking."""
    link, let_go = _Link(), list[tuple[str, str]]()
    resumes, table = _resumes(tokenizer, link, let_go)
    task = asyncio.create_task(resumes.resume(f"cmpl-{ID}", Position(0), False))
    await _until(lambda: link.asked(ID) >= 1)
    bad = msgspec.structs.replace(_found(ID), **changes)
    resumes.answered(b"d0", bad)
    with pytest.raises(ApiError) as err:
        await task
    assert err.value.status == 502 and "malformed" in err.value.message, err.value.message
    assert let_go == [(bad.request_id, "d0")]
    assert len(table) == 0 and not resumes.asking and not resumes.claims(f"{ID}.0")


async def _resumed(tokenizer, have: Position, answer: Adopted, include_usage: bool = False,
                   let_go: list | None = None):  # fmt: skip
    resumes, _ = _resumes(tokenizer, _Link(), let_go)
    task = asyncio.create_task(resumes.resume(f"cmpl-{ID}", have, include_usage))
    await _until(lambda: ID in resumes.asking)
    resumes.answered(b"d0", answer)
    return await task


async def test_a_resumed_stream_is_written_with_its_requests_output_options(tokenizer):
    """The node hands back the request's output options and `created` as the gateway that
    placed it encoded them: the stream is written with them, though the resume asked for
    none; one kept by an older node (none) takes the resume's `include_usage` alone."""
    options = StreamFormat(created=1234, include_usage=True, return_token_ids=True)
    kept = msgspec.structs.replace(_found(ID), stream_format=options.encode())
    req, _, _ = await _resumed(tokenizer, Position(0), kept)
    assert (req.created, req.include_usage, req.return_token_ids) == (1234, True, True)
    req, _, _ = await _resumed(tokenizer, Position(0), _found(ID), include_usage=True)
    assert req.include_usage and not req.return_token_ids and req.created > 1234


@pytest.mark.parametrize("after", ["finish", "usage"])
async def test_an_event_after_the_text_is_resumed_only_where_the_stream_ended(tokenizer, after):
    """`2.finish`, `2.usage`: the client has the stream's end at 2 tokens. A stream that ended
    there is resumed (its events after that one follow); one still running, or that ended
    elsewhere, is a 409 (no such event) and let go again."""
    words = tuple(tokenizer.encode(" one two", add_special_tokens=False))
    assert len(words) == 2  # a chunk may end after each
    ended = msgspec.structs.replace(_found(ID, words), finish_reason="length")
    req, _, _ = await _resumed(tokenizer, Position(2, after), ended)
    assert req.finished and req.output_ids == list(words)
    for answer, have in ((_found(ID, words), 2), (ended, 1)):
        let_go: list[tuple[str, str]] = []
        with pytest.raises(ApiError) as err:
            await _resumed(tokenizer, Position(have, after), answer, let_go=let_go)
        assert err.value.status == 409 and f"{have}.{after}" in err.value.message
        assert let_go == [(f"{ID}.0", "d0")]
