"""A node's registrations, on its control plane (common/node/control.py, gateways.py): whom it
deregisters from when it stops (only the gateways it asked to register it, that did not
refuse it), and how long it has served its role, said in every Register after the first
(the gateway's role-switch dwell runs on from it: gateway/roles.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import zmq.asyncio

from pdserve.common.config import NodeConfig
from pdserve.common.node.control import ControlPlane, RegistrationRefused
from pdserve.common.node.links import GatewayLink
from pdserve.common.wire.protocol import (
    Deregister,
    HeartbeatReply,
    NodeInfo,
    Register,
    RegisterAck,
    RegisterRefuse,
)
from tests.unit.test_several_gateways import _info, _Node


class _Serving(_Node):
    """What a node's control plane asks of the node beyond Adoption's."""

    def info(self) -> NodeInfo:
        return _info("node-x")

    def idle(self) -> bool:
        return not self.requests

    def hung(self) -> str | None:
        return None


class _Role:
    role, pushes_tokens = "decode", False

    def on_drain(self) -> None:
        pass

    def on_registered(self, ack: RegisterAck) -> None:
        pass


@asynccontextmanager
async def _control_plane(monkeypatch: Any) -> AsyncIterator[tuple[ControlPlane, list]]:
    """A node's control plane linked to two gateways that are not there, and what it sends
    (link, message) kept in a list: nothing goes on the wire. Its loops end (again:
    harmless) before its sockets close."""
    sent: list[tuple[GatewayLink, Any]] = []

    async def recorded(link: GatewayLink, msg: Any) -> None:
        sent.append((link, msg))

    monkeypatch.setattr(GatewayLink, "send", recorded)
    cfg = NodeConfig(gateway="tcp://127.0.0.1:9,tcp://127.0.0.1:10", node_id="node-x")
    events: Any = SimpleNamespace(resync=lambda: None, take=lambda: [], seq=lambda: -1)
    metrics: Any = SimpleNamespace(orphans=lambda outcome, n: None)
    node: Any = _Serving()
    role: Any = _Role()
    ctx = zmq.asyncio.Context()
    control = ControlPlane(cfg, "node-x", ctx, node, role, events, metrics)
    try:
        yield control, sent
    finally:
        await control.stop()
        control.close()
        ctx.term()


def _sent(sent: list, kind: type) -> list[tuple[GatewayLink, Any]]:
    return [(link, msg) for link, msg in sent if isinstance(msg, kind)]


async def test_a_role_signalled_as_it_started_deregisters_from_no_gateway(monkeypatch):
    """Signalled before it registered (a switch's new role, or a first start), a role drains
    at once and registers with no gateway: it sent each one a Deregister all the same."""
    async with _control_plane(monkeypatch) as (control, sent):
        control.begin_drain()
        await control.start([])
        await control.stop()
        assert _sent(sent, Register) == [] and _sent(sent, Deregister) == []


async def test_a_node_refused_by_one_gateway_deregisters_from_the_other_alone(monkeypatch):
    """The refusing gateway never took it (the id may be another process's there); the other,
    asked too, may have: it hears the node leave instead of waiting out its lease."""
    async with _control_plane(monkeypatch) as (control, sent):
        await control.start([])
        refusing, other = control.links
        assert [link for link, _ in _sent(sent, Register)] == [refusing, other]
        with pytest.raises(RegistrationRefused):
            await control._dispatch(refusing, RegisterRefuse(node_id="node-x", reason="model"))
        await control.stop()
        assert [link for link, _ in _sent(sent, Deregister)] == [other]


async def test_a_node_registering_again_says_how_long_it_has_served_its_role(monkeypatch):
    """Dropped by a gateway (a late heartbeat) or asked by a restarted one, the same process
    registers again: its role-switch dwell runs on from its first registration
    (gateway/roles.py), so it says how long ago that was; a first registration says 0."""
    async with _control_plane(monkeypatch) as (control, sent):
        await control.start([])
        a, b = control.links
        assert [msg.served_s for _, msg in _sent(sent, Register)] == [0.0, 0.0]
        for link, gateway_id in ((a, "g-a"), (b, "g-b")):
            ack = RegisterAck(node_id="node-x", tokens_address="tcp://127.0.0.1:11",
                              gateway_id=gateway_id)  # fmt: skip
            await control._dispatch(link, ack)
            if link is a:  # its first registration, 40 s ago; b's later one starts nothing
                assert control.gateways.first_ack is not None
                control.gateways.first_ack -= 40.0
        sent.clear()
        await control._dispatch(a, HeartbeatReply(unknown_node=True))  # dropped there
        [(link, again)] = _sent(sent, Register)
        assert link is a and 40.0 <= again.served_s < 60.0


async def test_a_gateway_whose_socket_is_full_holds_up_no_others_deregister(monkeypatch):
    """Leaving, a role sends each gateway its Deregister side by side, each send bounded:
    one gateway whose socket takes nothing (gone, its queue full) costs the others nothing
    (one after another, it used the whole wait and the next got none)."""
    async with _control_plane(monkeypatch) as (control, sent):
        recorded = GatewayLink.send  # the recorder the control plane sends through
        await control.start([])
        stuck, other = control.links

        async def full(link: GatewayLink, msg: Any) -> None:
            if link is stuck and isinstance(msg, Deregister):
                await asyncio.Event().wait()  # never sent
            await recorded(link, msg)

        monkeypatch.setattr(GatewayLink, "send", full)
        await control.stop()
        assert [link for link, _ in _sent(sent, Deregister)] == [other]
