"""free_port hands out ports an outgoing connection cannot take before the server binds."""

from __future__ import annotations

import socket

import pytest

from pdserve.common.wire import transport
from pdserve.common.wire.transport import _ephemeral_low, free_port


def test_free_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    low = _ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(10_000 <= p < low for p in ports), ports
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # a range of ten ports, five of them held by sockets free_port did not hand out
    monkeypatch.setattr(transport, "_ephemeral_low", lambda: 10_010)
    monkeypatch.delenv("PDSERVE_PORT_RANGE", raising=False)  # set for each test worker
    monkeypatch.setattr(transport, "_GIVEN", set())
    held = []
    try:
        for port in range(10_000, 10_010, 2):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # held by something else already: as good
                s.close()
                continue
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        given = {free_port() for _ in range(10 - len(held))}
        assert not taken & given
        assert given <= set(range(10_000, 10_010))
    finally:
        for s in held:
            s.close()


def test_a_port_range_keeps_processes_that_pick_at_once_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # what tests/conftest.py gives each pytest-xdist worker: a slice of its own
    monkeypatch.setattr(transport, "_GIVEN", set())
    monkeypatch.setenv("PDSERVE_PORT_RANGE", "20000-20040")
    ports = {free_port() for _ in range(20)}
    assert len(ports) == 20 and all(20_000 <= p < 20_040 for p in ports), ports
    for bad in ("", "20000", "x-y", "20040-20000"):  # not a range: the default one
        monkeypatch.setenv("PDSERVE_PORT_RANGE", bad)
        assert transport._port_range() == (10_000, max(_ephemeral_low(), 10_001))
