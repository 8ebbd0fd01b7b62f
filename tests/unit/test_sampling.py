import pytest
import torch

from pdserve.common.engine.sampler import sample
from pdserve.common.sampling import InvalidSampling, SamplingParams, counter_uniform


def test_counter_uniform_is_a_pure_function_in_range():
    draws = [counter_uniform(42, p) for p in range(2000)]
    assert draws == [counter_uniform(42, p) for p in range(2000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.03
    assert counter_uniform(42, 5) != counter_uniform(43, 5)


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 0},
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"temperature": 2.5},
        {"min_p": 1.5},
        {"seed": 1 << 64},
    ],
)
def test_invalid_params_are_rejected_naming_the_field(bad):
    with pytest.raises(InvalidSampling) as err:
        SamplingParams(**bad)
    assert err.value.field == next(iter(bad))


def test_greedy_and_top_k_1_pick_the_argmax():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0.0)
    topk1 = SamplingParams(temperature=1.0, top_k=1, seed=3)
    expected = logits.argmax(-1).tolist()
    assert sample(logits, [greedy] * 3, [1, 2, 3]) == expected
    assert sample(logits, [topk1] * 3, [1, 2, 3]) == expected


@pytest.mark.parametrize("temperature", [1e-39, 1e-20, 9e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature):
    """logits / 1e-39 overflows float32 (softmax of inf - inf is NaN, and the inverse CDF
    then picked the last token: the least likely one)."""
    logits = torch.tensor([[1.0, 5.0, 2.0, 0.0, -3.0]] * 8)
    p = SamplingParams(temperature=temperature, seed=7)
    assert p.greedy
    assert sample(logits, [p] * 8, list(range(8))) == [1] * 8
    # the smallest temperature that is sampled still divides without overflow
    tiny = SamplingParams(temperature=1e-5, seed=7)
    assert not tiny.greedy and sample(logits, [tiny] * 8, list(range(8))) == [1] * 8


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=1234)
    batch = sample(logits, [p] * 4, [10, 11, 12, 13])
    alone = [sample(logits[i : i + 1], [p], [10 + i])[0] for i in range(4)]
    assert batch == alone
    other_seed = [sample(logits[i : i + 1], [p.with_seed(99)], [10 + i])[0] for i in range(4)]
    # different seeds give different draws on a flat-ish distribution (4 chances to differ)
    assert other_seed != batch


def test_top_p_and_top_k_restrict_the_support():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0, -1.0]])
    picks_p = {
        sample(logits, [SamplingParams(temperature=1.0, top_p=0.5, seed=s)], [0])[0]
        for s in range(50)
    }
    assert picks_p == {0}
    picks_k = {
        sample(logits, [SamplingParams(temperature=1.0, top_k=2, seed=s)], [0])[0]
        for s in range(200)
    }
    assert picks_k == {0, 1}


def test_min_p_drops_tokens_far_less_likely_than_the_top_one():
    probs = torch.tensor([[0.5, 0.3, 0.12, 0.08]])  # min_p 0.2: keep p >= 0.1
    picks = {
        sample(torch.log(probs), [SamplingParams(temperature=1.0, min_p=0.2, seed=s)], [0])[0]
        for s in range(300)
    }
    assert picks == {0, 1, 2}


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    p = SamplingParams(temperature=1.0, seed=5)
    counts = [0, 0, 0]
    for pos in range(3000):
        counts[sample(logits, [p], [pos])[0]] += 1
    assert abs(counts[0] / 3000 - 0.7) < 0.03
    assert abs(counts[2] / 3000 - 0.1) < 0.02


def test_top_p_after_min_p_weighs_the_mass_min_p_left():
    # 0.4 and 0.35 pass min_p 0.5; renormalized, 0.4 / 0.75 = 0.53 already reaches top_p
    # 0.5 (vLLM: min-p masks, the distribution renormalizes, then top-p). Measured against
    # the mass before min-p (0.4 < 0.5), token 1 was kept and drawn ~47 % of the time
    from pdserve.common.engine.sampler import _sample_row

    logits = torch.log(torch.tensor([0.4, 0.35, 0.05, 0.05, 0.05, 0.05, 0.05]))
    p = SamplingParams(temperature=1.0, min_p=0.5, top_p=0.5, seed=1)
    assert {_sample_row(logits, p, (i + 0.5) / 1000) for i in range(1000)} == {0}


def test_a_draw_next_to_one_never_picks_a_token_of_no_mass():
    # u within 2^-25 of 1 made u x mass round to the whole mass in float32: the clamp then
    # took the last sorted token, the least likely of the vocabulary
    from pdserve.common.engine.sampler import _sample_row

    logits = torch.tensor([5.0, 5.0, -200.0, -300.0])
    for u in (1 - 2**-53, 1 - 2**-30, 1 - 2**-26):
        assert _sample_row(logits, SamplingParams(temperature=1.0, seed=1), u) in (0, 1)


def test_top_k_breaks_ties_by_token_id_as_the_full_sort_does():
    """torch.topk leaves the order of equal logits (and which of them make the cut) to the
    build; top-k must take the first k of the stable sort, as the unfiltered path orders."""
    from pdserve.common.engine.sampler import _top_k

    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        # bf16-rounded logits, as a bf16 model's: many ties in the head
        logits = torch.randn(4096, generator=gen).to(torch.bfloat16).float()
        for k in (1, 7, 50, 333):
            values, ids = _top_k(logits, k)
            ref_values, ref_ids = torch.sort(logits, descending=True, stable=True)
            assert torch.equal(ids, ref_ids[:k]), (trial, k)
            assert torch.equal(values, ref_values[:k])
    tied = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0, 3.0])  # the cut falls among equal values
    assert _top_k(tied, 3)[1].tolist() == [1, 2, 4]
    # through sample(): three equal tokens under top_k=3, a draw in the middle third takes
    # the second by id (torch.topk ordered them 1, 5, 4 on the CPU build: it took 5)
    seed = next(s for s in range(1000) if 1 / 3 < counter_uniform(s, 0) < 2 / 3)
    p = SamplingParams(temperature=1.0, top_k=3, seed=seed)
    assert sample(tied[None], [p], [0]) == [2]
