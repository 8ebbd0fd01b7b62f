"""Addresses over IPv4 and IPv6: an IPv6 literal written in brackets wherever a URL or a
ZeroMQ or tcp endpoint is built, read back without them where HOST:PORT is split, and a
node's own address and listener found for a gateway reached over IPv6."""

from __future__ import annotations

import socket
import time

import pytest

from pdserve.common.config import NodeConfig
from pdserve.common.errors import ConfigError
from pdserve.common.node import facing_address, links, resolve_tokens_address
from pdserve.common.wire.address import EVERYWHERE, bracket, host_port, split_host_port
from pdserve.common.wire.transport import listen_host


def test_hosts_are_bracketed_and_split_back():
    assert [bracket(h) for h in ("10.0.0.1", "gw", "*", "::1", "[::1]", "fd00::2")] == [
        "10.0.0.1", "gw", "*", "[::1]", "[::1]", "[fd00::2]"]  # fmt: skip
    assert host_port("::1", 8001) == "[::1]:8001"
    assert host_port("10.0.0.1", 8001) == "10.0.0.1:8001"
    assert split_host_port("tcp://[::1]:8001") == ("::1", 8001)
    assert split_host_port("[fd00::2]:5000") == ("fd00::2", 5000)
    assert split_host_port("tcp://10.0.0.1:8001") == ("10.0.0.1", 8001)
    assert split_host_port("gw:9") == ("gw", 9)
    assert split_host_port("tcp://[::]:41234") == ("::", 41234)  # a ZeroMQ LAST_ENDPOINT
    for bad in ("ipc:///tmp/gw", "gw", "[::1]"):
        with pytest.raises(ValueError):
            split_host_port(bad)


def test_a_node_reached_at_ipv6_loopback_listens_there():
    """A gateway at tcp://[::1]: the node advertised its host name (an IPv4 route asked for
    ::1) and listened on 0.0.0.0, which no IPv6 peer reaches."""
    assert facing_address("tcp://[::1]:8001") == "::1"
    assert listen_host("::1") == listen_host("[::1]") == "::1"
    assert listen_host("127.0.0.1") == listen_host("localhost") == "127.0.0.1"
    assert listen_host("fd00::2") == listen_host("10.0.0.5") == EVERYWHERE
    assert facing_address("tcp://127.0.0.1:8001") == "127.0.0.1"
    assert resolve_tokens_address("tcp://:8002", "tcp://[::1]:8001") == "tcp://[::1]:8002"
    assert resolve_tokens_address("tcp://:8002", "tcp://gw:8001") == "tcp://gw:8002"


def test_a_gateway_address_takes_an_ipv6_host_in_brackets_only():
    assert NodeConfig(gateway="tcp://[::1]:8001,tcp://[fd00::2]:8011").gateway
    with pytest.raises(ConfigError, match=r"tcp://\[::1\]:PORT"):
        NodeConfig(gateway="tcp://::1:8001")  # where does the port start?


def test_a_gateway_name_resolves_to_ipv4_or_else_ipv6(monkeypatch):
    """A name resolving only to IPv6 addresses (an IPv6-only Kubernetes Service) was no
    gateway at all (IPv4 answers alone were kept); a name with both stays IPv4's, one
    gateway per address as before."""
    answers = {
        "v6only": [(socket.AF_INET6, "fd00::7"), (socket.AF_INET6, "fd00::8")],
        "both": [(socket.AF_INET6, "fd00::7"), (socket.AF_INET, "10.0.0.7")],
    }

    def getaddrinfo(host, port, *args, **kwargs):
        return [(family, socket.SOCK_STREAM, 6, "", (ip, port)) for family, ip in answers[host]]

    monkeypatch.setattr(links.socket, "getaddrinfo", getaddrinfo)
    assert links.gateway_addresses("tcp://v6only:8001") == [
        "tcp://[fd00::7]:8001", "tcp://[fd00::8]:8001"]  # fmt: skip
    assert links.gateway_addresses("tcp://both:8001") == ["tcp://10.0.0.7:8001"]


def test_gateway_names_are_looked_up_side_by_side(monkeypatch):
    """A stopped gateway's name failing after the resolver's timeout held up every other
    name's lookup (one after another: a node's start waited the sum); side by side, three
    names each 0.4 s take one lookup's time. An address that is no name is looked up not."""
    slow = 0.4

    def getaddrinfo(host, port, *args, **kwargs):
        time.sleep(slow)
        if host == "stopped":
            raise socket.gaierror("Temporary failure in name resolution")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (f"10.0.0.{len(host)}", port))]

    monkeypatch.setattr(links.socket, "getaddrinfo", getaddrinfo)
    given = "tcp://stopped:8001,tcp://gw:8011,tcp://127.0.0.1:8021,tcp://other:8031"
    began = time.monotonic()
    found = links.resolve(given)
    took = time.monotonic() - began
    assert found == {
        "tcp://stopped:8001": [],
        "tcp://gw:8011": ["tcp://10.0.0.2:8011"],
        "tcp://127.0.0.1:8021": [],
        "tcp://other:8031": ["tcp://10.0.0.5:8031"],
    }
    # one lookup's time and a thread pool's start; one after another: 3 x 0.4 s
    assert took < 2 * slow, took
