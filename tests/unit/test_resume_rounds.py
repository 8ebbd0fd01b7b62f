"""The gateway's rounds of `Adopt` (gateway/resume.py): one failed round does not end the
asking, a stream taken over from a dead connection here is not asked for before it is let go,
a stream being placed again is not taken over, and stopping the gateway ends the rounds (what
is made of the answers: test_resume_answers.py)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.common.sampling import SamplingParams
from pdserve.common.wire.protocol import Adopt, Adopted
from pdserve.gateway.cluster import ClusterView
from pdserve.gateway.openai_api import ApiError
from pdserve.gateway.requests import GatewayRequest
from pdserve.gateway.resume import ROUND_S, Resumes
from pdserve.gateway.stream_state import Position
from pdserve.gateway.table import RequestTable
from tests.unit.test_several_gateways import _info

ID = "0123456789abcdef01234567"  # a request id as the gateway makes them (24 hex)


class _Link:
    """The gateway's sockets to its nodes: what went out, and a first send that fails."""

    def __init__(self, fail_first: bool = False, broken: str = "") -> None:
        self.sent: list[Adopt] = []
        self.fail_first, self.broken = fail_first, broken
        self.to: list[str] = []  # the node of each sent message

    async def send(self, node, msg: Adopt) -> None:
        if self.fail_first or node.node_id == self.broken:
            self.fail_first = False
            raise OverflowError("can't serialize an int that large")
        self.sent.append(msg)
        self.to.append(node.node_id)

    def asked(self, rid: str) -> int:
        return sum(rid in dict(m.streams) for m in self.sent)


def _resumes(tokenizer, link: _Link, let_go: list | None = None, nodes: int = 1,
             timeout: float = 5.0) -> tuple[Resumes, RequestTable]:  # fmt: skip
    cluster = ClusterView(heartbeat_timeout=2.0)
    for i in range(nodes):
        assert cluster.register(_info(f"d{i}"), f"d{i}".encode(), 0.0, "t") is None
    table, gone = RequestTable(), let_go if let_go is not None else []
    resumes = Resumes(cluster, table, link, tokenizer, lambda: "m", timeout=timeout,  # type: ignore[arg-type]
                      limit=16, release=lambda w, n: gone.append((w, n)))  # fmt: skip
    return resumes, table


def _refuse(resumes: Resumes, rid: str) -> None:
    """d0's answer that ends a resume at once: 409, a position the stream does not have."""
    resumes.answered(b"d0", Adopted(request_id=rid, found=False,
                                    reason="Last-Event-ID 7 is not a position"))  # fmt: skip


async def _until(check, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_failed_round_does_not_end_the_asking(tokenizer):
    """A round that raises (a message the wire cannot encode, a socket error) is logged; the
    stream is asked for again a round later, and others after it too."""
    link = _Link(fail_first=True)
    resumes, _ = _resumes(tokenizer, link)
    first = asyncio.create_task(resumes.resume(f"cmpl-{ID}", Position(7), False))
    await _until(lambda: link.asked(ID) >= 1)  # the round after the failed one
    _refuse(resumes, ID)
    with pytest.raises(ApiError) as err:
        await first
    assert err.value.status == 409
    other = "f" * 24
    second = asyncio.create_task(resumes.resume(f"cmpl-{other}", Position(7), False))
    await _until(lambda: link.asked(other) >= 1)
    _refuse(resumes, other)
    with pytest.raises(ApiError):
        await second


def _live(tokenizer, table: RequestTable, rid: str) -> tuple[GatewayRequest, list[int]]:
    req = GatewayRequest(request_id=rid, kind="completion", model="m", prompt_ids=[5, 6],
                         params=SamplingParams(max_tokens=8, temperature=0.0), stream=True,
                         include_usage=False, tokenizer=tokenizer)  # fmt: skip
    hung: list[int] = []
    req.hangup = lambda: hung.append(1)
    table.open(req, 2)
    return req, hung


async def test_a_stream_taken_over_here_is_asked_for_only_once_let_go(tokenizer):
    """A client resumes, at the gateway serving it, a stream whose connection is dead: the
    gateway hangs that connection up and asks the nodes for the stream only once it is out
    of its table (its `Release` sent). Asked earlier, by a round another resume keeps
    going, the node would hand it over while still this gateway's, and the old handler's
    Release would then make the served stream an orphan."""
    link = _Link()
    resumes, table = _resumes(tokenizer, link)
    other = "f" * 24
    busy = asyncio.create_task(resumes.resume(f"cmpl-{other}", Position(7), False))  # rounds go on
    await _until(lambda: link.asked(other) >= 1)
    req, hung = _live(tokenizer, table, ID)
    table.adopt(table.current(req), "d0", 0.0)  # decoding on d0  # type: ignore[arg-type]
    taken = asyncio.create_task(resumes.resume(f"cmpl-{ID}", Position(7), False))
    await _until(lambda: hung == [1])
    rounds = len(link.sent)
    await _until(lambda: len(link.sent) >= rounds + 2, timeout=4 * ROUND_S + 2)
    assert link.asked(ID) == 0  # still in the table: not asked for
    table.close(req.wire_id)  # the handler ended, the stream let go
    await _until(lambda: link.asked(ID) >= 1)
    for rid, task in ((ID, taken), (other, busy)):
        _refuse(resumes, rid)
        with pytest.raises(ApiError):
            await task


async def test_a_stream_being_placed_again_is_not_taken_over(tokenizer):
    """A resume of a live stream that lost its node and waits for a new one: nothing holds
    it to adopt, so its connection is not hung up; 409, the client retries."""
    link = _Link()
    resumes, table = _resumes(tokenizer, link)
    _, hung = _live(tokenizer, table, ID)  # offered, no node has it
    with pytest.raises(ApiError) as err:
        await resumes.resume(f"cmpl-{ID}", Position(0), False)
    assert err.value.status == 409 and hung == [] and link.sent == []


async def test_one_node_failing_to_be_asked_keeps_no_other_from_being_asked(tokenizer):
    """A round's message to one node fails (its socket): the other nodes are asked in the
    same round, and the stream is found on one of them."""
    link = _Link(broken="d0")
    resumes, _ = _resumes(tokenizer, link, nodes=2)
    task = asyncio.create_task(resumes.resume(f"cmpl-{ID}", Position(7), False))
    await _until(lambda: "d1" in link.to)
    resumes.answered(b"d1", Adopted(request_id=ID, found=False,
                                    reason="Last-Event-ID 7 is not a position"))  # fmt: skip
    with pytest.raises(ApiError):
        await task


async def test_stopping_the_gateway_ends_the_rounds_while_a_stream_is_looked_for(tokenizer):
    """The gateway stops with a resume still asking: `stop()` ends the rounds' task, so no
    round goes out on the sockets the gateway closes next (it would fail on a closed
    socket, logged as an error at every shutdown)."""
    link = _Link()
    resumes, _ = _resumes(tokenizer, link)
    waiting = asyncio.create_task(resumes.resume(f"cmpl-{ID}", Position(7), False))
    await _until(lambda: link.asked(ID) >= 1)  # the rounds run: nobody answers
    asker = resumes._asker
    assert asker is not None and not asker.done()
    await resumes.stop()
    assert asker.done()
    rounds = len(link.sent)
    await asyncio.sleep(ROUND_S * 1.5)  # a round would have gone out again by now
    assert len(link.sent) == rounds
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


def test_a_stream_let_go_again_moves_to_the_end_of_the_let_go_list(tokenizer):
    """`let_go` is trimmed from its oldest entry: one let go again (a client resuming an ended
    stream over and over) must move to the end, or every entry behind it stays forever."""
    resumes, _ = _resumes(tokenizer, _Link())
    resumes.released("a.0", 0.0)
    resumes.released("b.0", 1.0)
    resumes.released("a.0", 4.0)
    resumes.released("c.0", 6.5)  # trims: b is 5.5 s old, a 2.5 s
    assert list(resumes.let_go) == ["a.0", "c.0"]
