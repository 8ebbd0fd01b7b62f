"""Container awareness: the DNS PTR query and answer parsing that give a node its compose
name, the replica number in that name, the GPU a `cuda:auto` replica takes, and the
addresses a node advertises. The live path (Docker's DNS) runs in tests/e2e/test_compose.py."""

from __future__ import annotations

import struct

import pytest

from pdserve.common.container import (
    embedded_dns,
    parse_ptr_answer,
    ptr_query,
    replica_from_name,
)
from pdserve.common.devices import pick_gpu
from pdserve.common.node import facing_address, resolve_tokens_address


def _answer(query: bytes, name: str, compress: bool) -> bytes:
    """A DNS response to `query` with one PTR record, as Docker's resolver builds it."""
    qid = struct.unpack(">H", query[:2])[0]
    header = struct.pack(">HHHHHH", qid, 0x8180, 1, 1, 0, 0)
    question = query[12:]
    owner = b"\xc0\x0c" if compress else question[:-4]
    rdata = b"".join(bytes([len(x)]) + x.encode() for x in name.split(".")) + b"\0"
    record = owner + struct.pack(">HHIH", 12, 1, 600, len(rdata)) + rdata
    return header + question + record


@pytest.mark.parametrize("compress", [True, False])
def test_ptr_answer_round_trip(compress):
    query = ptr_query("172.19.0.6", 4242)
    assert b"\x016\x010\x0219\x03172\x07in-addr\x04arpa\x00" in query
    answer = _answer(query, "pdserve-prefill-2.pdserve_nodes", compress)
    assert parse_ptr_answer(answer, 4242) == "pdserve-prefill-2.pdserve_nodes"


def test_ptr_answer_rejects_wrong_id_errors_and_garbage():
    query = ptr_query("10.0.0.1", 7)
    good = _answer(query, "x-decode-1.net", True)
    assert parse_ptr_answer(good, 8) is None  # not our query
    nxdomain = good[:2] + struct.pack(">H", 0x8183) + good[4:]
    assert parse_ptr_answer(nxdomain, 7) is None
    assert parse_ptr_answer(b"\x00\x07", 7) is None
    # a question name that points at itself: the bounded reader ends instead of spinning
    loop = good[:12] + b"\xc0\x0c" + good[14:]
    assert parse_ptr_answer(loop, 7) in (None, "", "x-decode-1.net")


def test_replica_number_from_compose_names():
    assert replica_from_name("pdserve-decode-3") == 3
    assert replica_from_name("my-project-prefill-12") == 12
    assert replica_from_name("7ee728ab5060") is None


def test_cuda_auto_gives_each_replica_its_own_gpu():
    # 2 prefill replicas then 2 decode replicas on 4 GPUs: all different
    taken = [pick_gpu(r, 0, 4) for r in (1, 2)] + [pick_gpu(r, 2, 4) for r in (1, 2)]
    assert sorted(taken) == [0, 1, 2, 3]
    assert pick_gpu(3, 0, 2) == 0  # more replicas than GPUs: wrap around


def test_advertised_addresses():
    assert facing_address("tcp://127.0.0.1:8001") == "127.0.0.1"
    assert facing_address("tcp://localhost:8001") == "127.0.0.1"
    routed = facing_address("tcp://10.255.255.1:8001")  # any routable address: not loopback
    assert routed and not routed.startswith("127.")
    assert resolve_tokens_address("tcp://:8002", "tcp://gateway:8001") == "tcp://gateway:8002"
    assert resolve_tokens_address("tcp://gw:9", "tcp://gateway:8001") == "tcp://gw:9"


@pytest.mark.cpu
def test_dtype_auto_is_bfloat16_only_where_it_runs_natively():
    from pdserve.common.numerics import choose_dtype

    assert choose_dtype("cuda:0", set())[0] == "bfloat16"
    assert choose_dtype("cuda", {"sse2"})[0] == "bfloat16"
    dtype, why = choose_dtype("cpu", {"avx2", "avx512f", "fma"})  # AVX-512, no AVX512-BF16
    assert dtype == "float32" and "lacks native bfloat16" in why
    for native in ("avx512_bf16", "amx_bf16", "bf16"):  # x86 AVX512-BF16, AMX, arm64
        dtype, why = choose_dtype("cpu", {"avx2", native})
        assert dtype == "bfloat16" and native in why


@pytest.mark.cpu
def test_dtype_auto_is_resolved_once_in_the_config(caplog):
    import logging

    from pdserve.common.config import EngineConfig
    from pdserve.common.numerics import choose_dtype

    with caplog.at_level(logging.INFO):
        cfg = EngineConfig(dtype="auto")
    assert cfg.dtype == choose_dtype("cpu")[0] != "auto"
    assert "--dtype auto" in caplog.text


def test_the_name_is_asked_only_where_docker_lists_its_embedded_dns(tmp_path):
    """A container on the default bridge (or the host's network) has no server at
    127.0.0.11: its node must not wait the query's timeout for a name nobody gives."""
    compose = tmp_path / "compose"
    compose.write_text("search example\nnameserver 127.0.0.11\noptions ndots:0\n")
    bridge = tmp_path / "bridge"
    bridge.write_text("# copied from the host\nnameserver 10.0.0.2\nnameserver 127.0.0.110\n")
    commented = tmp_path / "commented"
    commented.write_text("# nameserver 127.0.0.11\n\n")
    assert embedded_dns(str(compose))
    assert not embedded_dns(str(bridge)) and not embedded_dns(str(commented))
    assert not embedded_dns(str(tmp_path / "missing"))
