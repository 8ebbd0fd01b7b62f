"""A node id fits the 64-byte field that opens each tcp and UCX KV stream, and the names of
its shared-memory files: a longer one (a 64-byte host name in the default ROLE-HOST-PID) was
cut on the stream, its KV headers named the whole id, and every frame was discarded (every
transfer timed out); spaces around it were stripped by the listener, with the same end."""

from __future__ import annotations

import pytest

from pdserve.common import container
from pdserve.common.config import NodeConfig
from pdserve.common.errors import ConfigError
from pdserve.common.node import host
from pdserve.common.node_id import ID_BYTES, id_problem


@pytest.mark.parametrize(
    "node_id", ["x" * 65, " prefill-0", "prefill-0 ", "a/b", "nodé", "-x", ".hidden", "a b"]
)
def test_a_node_id_the_kv_streams_cannot_carry_is_refused_at_startup(node_id):
    with pytest.raises(ConfigError, match="--node-id"):
        NodeConfig(node_id=node_id)


@pytest.mark.parametrize("node_id", ["p", "prefill-0", "pdserve-decode-2", "a.b_c-1", "x" * 64])
def test_a_node_id_of_safe_characters_within_64_bytes_is_taken(node_id):
    assert NodeConfig(node_id=node_id).node_id == node_id


@pytest.mark.parametrize("hostname", ["h" * 64, "h" * 63 + "1", "weird host/name" * 8, ""])
def test_the_default_id_fits_whatever_the_host_name(monkeypatch, hostname):
    monkeypatch.setattr(container, "container_name", lambda: None)
    monkeypatch.setattr(host.socket, "gethostname", lambda: hostname)
    made = host.default_node_id("colocated")
    assert id_problem(made) is None and len(made.encode()) <= ID_BYTES, made
    assert made.startswith("colocated-") and made.endswith(f"-{host.os.getpid()}")


def test_long_host_names_of_one_prefix_give_different_default_ids(monkeypatch):
    monkeypatch.setattr(container, "container_name", lambda: None)
    ids = set()
    for last in "12":
        monkeypatch.setattr(host.socket, "gethostname", lambda last=last: "h" * 70 + last)
        ids.add(host.default_node_id("decode"))
    assert len(ids) == 2


def test_a_container_name_unfit_for_an_id_gives_way_to_the_default(monkeypatch):
    monkeypatch.setattr(container, "container_name", lambda: "c" * 80)
    monkeypatch.setattr(host.socket, "gethostname", lambda: "box")
    assert host.default_node_id("prefill") == f"prefill-box-{host.os.getpid()}"
    monkeypatch.setattr(container, "container_name", lambda: "pdserve-prefill-2")
    assert host.default_node_id("prefill") == "pdserve-prefill-2"
