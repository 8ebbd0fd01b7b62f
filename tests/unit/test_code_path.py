"""Nodes whose numbers come from another code path are refused (common/numerics.py,
gateway/cluster.py): the fused C kernels against eager ops, gguf_matmul.c's SIMD path against
torch's 4-bit kernel, AVX-512 against AVX2 differ in the last bits, so greedy text diverges
between nodes that all said "float32". A node that names no path (a sim engine, an older
version, a Probe before the load) is not held to one."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.common.numerics import code_path, isa_level, limited, path_difference
from pdserve.gateway.cluster import ClusterView
from tests.unit.test_cpu_isa import X86, XEON
from tests.unit.test_policies import make_info

FUSED = code_path(kernels="fused", linear="torch", isa="avx2")
EAGER = code_path(kernels="eager", linear="torch", isa="avx2")


def test_paths_differing_in_a_part_both_name_differ_and_say_how():
    assert FUSED == "kernels=fused;linear=torch;isa=avx2"
    assert path_difference(FUSED, FUSED) is None
    assert path_difference(EAGER, FUSED) == "kernels 'eager', not 'fused'"
    gguf = code_path(kernels="fused", linear="gguf-avx2", isa="avx512")
    assert (
        path_difference(gguf, FUSED) == "linear 'gguf-avx2', not 'torch', isa 'avx512', not 'avx2'"
    )
    # a part one side leaves out (unknown, or an older node's path) is not compared
    assert (
        path_difference(code_path(kernels="eager", isa=""), FUSED) == "kernels 'eager', not 'fused'"
    )
    assert path_difference("", FUSED) is None and path_difference(FUSED, "") is None


def test_the_gateway_refuses_a_node_on_another_path_and_names_the_difference():
    view = ClusterView(heartbeat_timeout=2.0)
    assert view.register(make_info("p0", code_path=FUSED), b"p0/1", 0.0, "t") is None
    why = view.register(make_info("p1", code_path=EAGER), b"p1/1", 0.0, "t")
    assert why is not None and "p1" in why and "kernels 'eager', not 'fused'" in why
    assert "p0" in why and "PDSERVE_CPU_ISA" in why
    assert view.register(make_info("p1", code_path=FUSED), b"p1/1", 0.0, "t") is None
    # a sim node, an older node, a GPU node: no path said, none held to
    assert view.register(make_info("p2"), b"p2/1", 0.0, "t") is None


def test_a_cluster_formed_by_nodes_naming_no_path_holds_later_ones_to_the_first_path():
    view = ClusterView(heartbeat_timeout=2.0)
    assert view.register(make_info("old"), b"old/1", 0.0, "t") is None  # an older version
    assert view.register(make_info("n1", code_path=FUSED), b"n1/1", 0.0, "t") is None
    why = view.register(make_info("n2", code_path=EAGER), b"n2/1", 0.0, "t")
    assert why is not None and "(n1)" in why


@pytest.mark.skipif(not X86, reason="x86 levels")
def test_the_level_is_the_vector_width_and_in_bfloat16_the_native_bf16():
    assert isa_level("float32", XEON) == "avx512"
    assert isa_level("float32", limited(XEON, "avx2")) == "avx2"  # PDSERVE_CPU_ISA=avx2
    assert isa_level("bfloat16", XEON) == "avx512+avx512_bf16+amx_bf16"
    assert isa_level("bfloat16", limited(XEON, "avx2")) == "avx2"
    assert isa_level("float32", set()) == ""  # unreadable flags: not compared


def test_a_probe_naming_another_cpu_level_is_refused_before_the_load():
    """A node of another CPU level was refused only at Register, after loading its weights
    (minutes for a large model) and then again at every restart: its Probe says its level."""
    from pdserve.common.wire.protocol import Probe

    view = ClusterView(heartbeat_timeout=2.0)
    info = make_info("n1", code_path=FUSED)
    assert view.register(info, b"n1/1", 0.0, info.tokenizer_fingerprint) is None
    probe = Probe(node_id="n2", model_id=info.model_id, dtype=info.dtype,
                  tokenizer_fingerprint=info.tokenizer_fingerprint, kv_layout=info.kv_layout,
                  code_path=code_path(isa="avx512"))  # fmt: skip
    why = view.refusal(probe, info.tokenizer_fingerprint, probed_at=0.0)
    assert why is not None and "isa 'avx512', not 'avx2'" in why
    same = Probe(**{**msgspec.structs.asdict(probe), "code_path": code_path(isa="avx2")})
    assert view.refusal(same, info.tokenizer_fingerprint, probed_at=0.0) is None


def test_a_cpu_nodes_probe_names_its_level():
    from pdserve.common.config import EngineConfig, NodeConfig
    from pdserve.common.node.precheck import probe_of

    ecfg = EngineConfig()
    probe = probe_of("decode", ecfg, NodeConfig(), "fingerprint")
    assert probe.code_path == code_path(isa=isa_level(ecfg.dtype))
    assert probe.dtype == ecfg.numerics
