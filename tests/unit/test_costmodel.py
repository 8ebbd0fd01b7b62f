import pytest

from pdserve.common.costmodel import GPUS, MODELS, CostModel


@pytest.fixture
def cost():
    return CostModel.named("h100-llama3.1-8b")


def test_unknown_profile_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown sim profile"):
        CostModel.named("tpu-gpt5")


def test_prefill_time_is_monotone_in_prompt_length(cost):
    times = [cost.prefill_seconds(n) for n in (1, 16, 128, 1024, 4000, 16000)]
    assert times == sorted(times) and times[0] < times[-1]


def test_decode_time_is_monotone_in_batch_and_context(cost):
    by_batch = [cost.decode_step_seconds([1000] * b) for b in (1, 8, 64, 256)]
    assert by_batch == sorted(by_batch) and by_batch[0] < by_batch[-1]
    by_ctx = [cost.decode_step_seconds([c] * 16) for c in (100, 1000, 10000)]
    assert by_ctx == sorted(by_ctx) and by_ctx[0] < by_ctx[-1]


def test_matches_the_roofline_formula(cost):
    g, m = GPUS["h100"], MODELS["llama3.1-8b"]
    n = 4000
    q_dim = m.num_heads * m.head_dim
    flops = 2 * m.params * n + 4 * m.num_layers * q_dim * n * (n + 1) / 2
    bytes_ = m.weight_bytes + m.kv_bytes_per_token * n
    expected = (
        max(flops / (g.peak_flops * g.mfu), bytes_ / (g.mem_bw * g.bw_eff)) + g.step_overhead_s
    )
    assert cost.prefill_seconds(n) == pytest.approx(expected)
    # a long prefill is compute-bound, a small decode batch bandwidth-bound
    assert flops / (g.peak_flops * g.mfu) > bytes_ / (g.mem_bw * g.bw_eff)
    ctx = [500] * 4
    dec_bytes = m.weight_bytes + m.kv_bytes_per_token * (sum(ctx) + len(ctx))
    assert cost.decode_step_seconds(ctx) == pytest.approx(
        dec_bytes / (g.mem_bw * g.bw_eff) + g.step_overhead_s, rel=1e-9
    )


def test_plausible_magnitudes_and_kv_size(cost):
    assert MODELS["llama3.1-8b"].kv_bytes_per_token == 131072
    # 8B on H100: tens of ms to prefill 4k tokens, ~6-8 ms per small decode step
    assert 0.05 < cost.prefill_seconds(4000) < 0.5
    assert 0.005 < cost.decode_step_seconds([1000]) < 0.015
    assert CostModel.named("h200-llama3.1-8b").decode_step_seconds(
        [1000]
    ) < cost.decode_step_seconds([1000])
    assert cost.transfer_seconds(4000) == pytest.approx(20e-6 + 4000 * 131072 / 50e9)
