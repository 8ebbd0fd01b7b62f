"""The simulated engine: same interface, cost-model timing, deterministic tokens, real-size KV."""

import sys
import time

import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.engine.interface import DecodeWork, PrefillWork
from pdserve.common.engine.sim import SimEngine
from pdserve.common.sampling import SamplingParams

P = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_sim_never_imports_torch():
    import subprocess

    code = (
        "import sys\n"
        "from pdserve.common.engine.llm_engine import LLMEngine\n"
        "from pdserve.common.config import EngineConfig\n"
        "from pdserve.common.sampling import SamplingParams\n"
        "e = LLMEngine(EngineConfig(engine='sim', sim_time_scale=0.01))\n"
        "print(len(e.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0].token_ids))\n"
        "assert 'torch' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "4"


def test_tokens_depend_only_on_seed_and_position():
    eng = SimEngine(EngineConfig(engine="sim"), sleep=False)
    a = eng.step([PrefillWork("a", [5] * 10, 0, [0], P)], [])
    b = eng.step([PrefillWork("b", [9] * 3, 7, [1], P)], [DecodeWork("c", 1, 9, [2], P)])
    assert b == [a[0], a[0]]  # same seed (none) and same position 10
    seeded = P.with_seed(3)
    c = eng.step([], [DecodeWork("d", 1, 9, [2], seeded)])
    assert c == eng.step([], [DecodeWork("e", 4, 9, [3], seeded)])


def test_waits_the_modelled_time_scaled_and_fires_every_layer():
    cfg = EngineConfig(engine="sim", sim_time_scale=8.0)  # ~0.5 s: jitter stays small
    eng = SimEngine(cfg)
    layers: list[int] = []
    work = [PrefillWork("a", list(range(2000)), 0, list(range(125)), P)]
    start = time.monotonic()
    eng.step(work, [], on_layer=layers.append)
    elapsed = time.monotonic() - start
    modelled = eng.cost.prefill_seconds(2000)
    assert layers == list(range(32))
    assert elapsed >= 8.0 * modelled * 0.99
    # the deadlines are absolute (only the last sleep's lateness counts); a wrong scale
    # (applied twice) or a step per layer is 2x or more
    assert elapsed < 8.0 * modelled * 1.5


def test_a_step_no_hook_watches_sleeps_once_for_its_whole_time(monkeypatch):
    """A wake per layer is CPU spent for nothing where no hook watches the layers land (a
    decode step, a prefill sent at its end): one wait to the same end. With a hook, one wait
    per layer, as before. No real sleeping: the waits are recorded."""
    import pdserve.common.engine.sim as sim

    waits: list[float] = []
    monkeypatch.setattr(sim.time, "sleep", waits.append)
    eng = SimEngine(EngineConfig(engine="sim", sim_time_scale=1000.0))
    work = [PrefillWork("a", list(range(2000)), 0, list(range(125)), P)]
    wall = 1000.0 * eng.cost.prefill_seconds(2000)
    eng.step(work, [])
    assert len(waits) == 1 and wall * 0.99 <= waits[0] <= wall
    waits.clear()
    eng.step(work, [], on_layer=lambda i: None)
    assert len(waits) == 32


def test_kv_frames_have_the_scaled_real_size():
    eng = SimEngine(EngineConfig(engine="sim", sim_kv_scale=0.5), sleep=False)
    real_per_layer = 131072 // 32  # Llama-3.1-8B fp16: 4 KiB per token per layer
    assert eng.kv_store.frame_bytes(100) == 100 * real_per_layer // 2
    frame = eng.kv_store.export_kv(3, list(range(7)), 100)  # 7 blocks of 16 tokens
    assert len(frame) == eng.kv_store.frame_bytes(100)
    eng.kv_store.import_kv(3, list(range(7, 14)), 100, frame)
    try:
        eng.kv_store.import_kv(3, list(range(7, 14)), 99, frame)
        raise AssertionError("a frame of the wrong size must be refused")
    except ValueError as exc:
        assert "expected" in str(exc)


def test_every_layer_frame_has_its_full_size_whatever_came_before():
    """A frame one byte short desynchronises a byte stream (the tcp KV backend): every
    layer's frame is whole, also right after a frame of half the size grew the buffer."""
    eng = SimEngine(EngineConfig(engine="sim"), sleep=False)
    for tokens in (16, 32, 33, 64, 7, 128):
        for layer in range(4):
            kv = eng.kv_store
            table = list(range(-(-tokens // kv.block_size)))
            assert len(kv.export_kv(layer, table, tokens)) == kv.frame_bytes(tokens)


def test_blocks_come_from_gpu_memory_minus_weights():
    eng = SimEngine(EngineConfig(engine="sim"), sleep=False)
    tokens = eng.num_blocks * eng.block_size
    # H100 80 GB x 0.9 - 16 GB weights, 128 KiB per token: about 430k tokens
    assert 400_000 < tokens < 460_000


def test_a_profile_whose_weights_fill_the_gpu_needs_its_blocks_given():
    """The 70B profiles on one GPU: no KV room. An engine of one block refused every request
    as too long; it is an error at start, unless the blocks are given."""
    with pytest.raises(ValueError, match=r"no KV room.*--num-kv-blocks"):
        SimEngine(EngineConfig(engine="sim", sim_profile="a100-llama3.1-70b"))
    given = EngineConfig(engine="sim", sim_profile="a100-llama3.1-70b", num_kv_blocks=64)
    assert SimEngine(given).num_blocks == 64


def test_the_simulated_cache_refuses_what_the_real_cache_refuses():
    """A node passing a short block table (reserving for the prompt but not its first
    token, say) passed every simulated cluster test and failed on a real engine."""
    import pytest

    from pdserve.common.engine.sim import SimKvStore

    kv = SimKvStore(num_layers=2, num_blocks=8, block_size=16, per_token=4)
    frame = bytes(kv.frame_bytes(20))
    kv.import_kv(0, [1, 2], 20, frame)
    assert len(kv.export_kv(1, [1, 2], 20)) == kv.frame_bytes(20)
    for table in ([1], [1, 8], [-1, 2]):  # short, past the cache, negative
        with pytest.raises(IndexError):
            kv.import_kv(0, table, 20, frame)
        with pytest.raises(IndexError):
            kv.export_kv(0, table, 20)
    with pytest.raises(IndexError):
        kv.read_block(10**6)
    with pytest.raises(ValueError):
        kv.write_block(5, b"too short")
    kv.write_block(5, kv.read_block(3))


def test_greedy_tokens_ignore_the_seed_as_a_real_engine_s_argmax_does():
    """The sim drew greedy requests' tokens from their seed: the same greedy request gave
    another text with another seed, which no real engine does."""
    eng = SimEngine(EngineConfig(engine="sim"), sleep=False)

    def tokens(params: SamplingParams) -> list[int]:
        return [eng.step([], [DecodeWork("d", 1, pos, [2], params)])[0] for pos in range(9, 15)]

    greedy = tokens(P)
    assert tokens(P.with_seed(1)) == tokens(P.with_seed(2)) == greedy
    top1 = SamplingParams(max_tokens=8, temperature=1.0, top_k=1, seed=5)  # greedy too
    assert tokens(top1) == greedy
    sampled = SamplingParams(max_tokens=8, temperature=1.0)
    assert tokens(sampled.with_seed(1)) != tokens(sampled.with_seed(2))  # the seed counts
    assert tokens(sampled) == greedy  # no seed: seed 0 (the gateway gives each one a seed)


def test_nodes_of_other_kv_scales_are_refused_at_registration():
    """`--sim-kv-scale` sets the frames' size but was not in the layout the gateway
    compares: nodes of two scales registered and every transfer between them failed."""
    from pdserve.common.wire.protocol import NodeInfo
    from pdserve.gateway.cluster import ClusterView

    def info(node_id: str, scale: float) -> NodeInfo:
        eng = SimEngine(EngineConfig(engine="sim", sim_kv_scale=scale), sleep=False)
        return NodeInfo(
            node_id=node_id, role="decode", data_address="", host_id="h",
            model_id=eng.model_id, dtype="sim", tokenizer_fingerprint="t",
            kv_layout=eng.model_config.layout_fingerprint(), block_size=eng.block_size,
            num_blocks=eng.num_blocks, max_batch=32, max_batch_tokens=8192,
            max_model_len=eng.max_model_len,
        )  # fmt: skip

    cluster = ClusterView(10.0)
    assert cluster.register(info("a", 1 / 16), b"a", 0.0, "t") is None
    assert cluster.register(info("b", 1 / 16), b"b", 0.0, "t") is None
    refused = cluster.register(info("c", 1 / 8), b"c", 0.0, "t")
    assert refused is not None and "kv_layout" in refused
