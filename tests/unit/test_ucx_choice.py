"""A sender without ucxx (a node's install without the extra, or a broken UCX) does not take
a decode node's ucx endpoint: every transfer to it timed out where another backend would
have carried it (a forced ucx falls back, as any forced backend the peer cannot take)."""

from __future__ import annotations

from pdserve.common.kv import choose, ucx


def test_without_ucxx_the_ucx_endpoint_is_not_usable(monkeypatch):
    sender = ucx.UcxSend.__new__(ucx.UcxSend)
    endpoints = {"ucx": "10.0.0.2:9000", "zmq": "tcp://10.0.0.2:9001"}
    monkeypatch.setattr(ucx, "available", lambda: True)
    assert sender.usable(endpoints["ucx"])
    monkeypatch.setattr(ucx, "available", lambda: False)
    assert not sender.usable(endpoints["ucx"])
    usable = {"ucx": sender.usable, "zmq": bool}
    assert choose("ucx", lambda b, ep: usable.get(b, bool)(ep), endpoints) == "zmq"
