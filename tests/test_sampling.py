"""Sampling transforms against hand-computed expectations, greedy choice, seeded draws, running counts."""

import math

import pytest
import torch

from specdec_core.sampling import (
    SamplingParams,
    adjust_logits,
    greedy_tokens,
    make_generator,
    running_counts,
    sample,
    to_probs,
)

# softmax(log([1, 2, 3, 4])) = [.1, .2, .3, .4]: hand-checkable probabilities.
LOGITS = torch.tensor([[1.0, 2.0, 3.0, 4.0]]).log()


def normalized(*weights: float) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(), normalized(1, 2, 3, 4)),
        # Temperature 0.5 squares the probabilities before renormalizing.
        (SamplingParams(temperature=0.5), normalized(1, 4, 9, 16)),
        (SamplingParams(temperature=2.0), normalized(1, 2**0.5, 3**0.5, 2)),
        (SamplingParams(top_k=2), normalized(0, 0, 3, 4)),
        (SamplingParams(top_k=4), normalized(1, 2, 3, 4)),
        # top_p keeps the smallest set of most likely tokens whose mass reaches top_p.
        (SamplingParams(top_p=0.7), normalized(0, 0, 3, 4)),
        (SamplingParams(top_p=0.75), normalized(0, 2, 3, 4)),
        (SamplingParams(top_p=0.3), normalized(0, 0, 0, 1)),
        (SamplingParams(top_p=0.01), normalized(0, 0, 0, 1)),
        (SamplingParams(top_p=0.0), normalized(0, 0, 0, 1)),  # the likeliest token always stays
        # top_p acts after temperature: at 0.5 the probabilities are [1, 4, 9, 16] / 30.
        (SamplingParams(temperature=0.5, top_p=0.75), normalized(0, 0, 9, 16)),
        # top_p acts on the top-k renormalized distribution [2, 3, 4] / 9.
        (SamplingParams(top_k=3, top_p=0.75), normalized(0, 0, 3, 4)),
        (SamplingParams(logit_bias={0: math.log(4.0)}), normalized(4, 2, 3, 4)),
        (SamplingParams(logit_bias={3: -math.inf}), normalized(1, 2, 3, 0)),
        # logit bias acts before top_k: token 0 becomes the most likely.
        (SamplingParams(logit_bias={0: math.log(10.0)}, top_k=1), normalized(1, 0, 0, 0)),
    ],
)
def test_to_probs(params, expected):
    torch.testing.assert_close(to_probs(LOGITS, params)[0], torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_penalties_follow_openai_definition():
    counts = torch.tensor([[0.0, 2.0, 1.0, 0.0]])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    adjusted = adjust_logits(torch.zeros(1, 4), params, counts)
    # logit -= frequency * count + presence * (count > 0)
    torch.testing.assert_close(adjusted, torch.tensor([[0.0, -1.25, -0.75, 0.0]]))


def test_penalties_apply_row_by_row_and_combine_with_bias():
    counts = torch.tensor([[0.0, 0.0, 0.0, 0.0], [3.0, 0.0, 0.0, 1.0]])
    params = SamplingParams(frequency_penalty=1.0, logit_bias={1: 2.0})
    adjusted = adjust_logits(torch.zeros(2, 4), params, counts)
    torch.testing.assert_close(adjusted, torch.tensor([[0.0, 2.0, 0.0, 0.0], [-3.0, 2.0, 0.0, -1.0]]))


def test_penalties_need_counts_and_leave_the_input_alone():
    logits = LOGITS.clone()
    params = SamplingParams(presence_penalty=1.0, logit_bias={0: 1.0})
    assert torch.equal(adjust_logits(logits, SamplingParams(presence_penalty=1.0)), logits)  # no counts: no penalty
    adjust_logits(logits, params, torch.ones(1, 4))
    assert torch.equal(logits, LOGITS)


def test_penalized_probabilities():
    counts = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    probs = to_probs(LOGITS, SamplingParams(presence_penalty=math.log(2.0)), counts)
    torch.testing.assert_close(probs[0], torch.tensor(normalized(1, 2, 3, 2)))


@pytest.mark.parametrize(
    "params, counts, expected",
    [
        (SamplingParams(temperature=0), None, 3),
        (SamplingParams(temperature=0, logit_bias={0: 10.0}), None, 0),
        (SamplingParams(temperature=0, frequency_penalty=1.0), torch.tensor([[0.0, 0.0, 0.0, 3.0]]), 2),
        (SamplingParams(temperature=0, presence_penalty=5.0), torch.tensor([[0.0, 0.0, 1.0, 1.0]]), 1),
        # Penalties without counts to apply them to change nothing.
        (SamplingParams(temperature=0, presence_penalty=5.0), None, 3),
    ],
)
def test_greedy_is_argmax_after_bias_and_penalties(params, counts, expected):
    assert params.greedy
    assert greedy_tokens(LOGITS, params, counts).tolist() == [expected]


def test_greedy_and_uses_counts_flags():
    assert not SamplingParams(temperature=0.1).greedy
    assert not SamplingParams().uses_counts
    assert SamplingParams(frequency_penalty=-0.5).uses_counts
    assert SamplingParams(presence_penalty=0.1).uses_counts


def draws(seed: int | None, n: int = 64) -> list[int]:
    generator = make_generator(seed, torch.device("cpu"))
    probs = torch.full((1, 16), 1 / 16)
    return [int(sample(probs, generator)) for _ in range(n)]


def test_same_seed_same_draws():
    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert draws(None) != draws(None)  # an unseeded generator is seeded from entropy


def test_sample_draws_one_token_per_row_from_its_own_row():
    probs = torch.eye(5)[[4, 0, 2]]
    assert sample(probs, make_generator(0, torch.device("cpu"))).tolist() == [4, 0, 2]


def test_sample_frequencies_follow_probs():
    generator = make_generator(1, torch.device("cpu"))
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).expand(20_000, 4)
    freq = torch.bincount(sample(probs, generator), minlength=4) / 20_000
    torch.testing.assert_close(freq, probs[0], atol=0.015, rtol=0)


def test_running_counts():
    base = torch.tensor([1.0, 0.0, 0.0, 0.0])
    counts = running_counts(base, torch.tensor([2, 0, 2]), 4)
    expected = torch.tensor([[1, 0, 0, 0], [1, 0, 1, 0], [2, 0, 1, 0], [2, 0, 2, 0]], dtype=torch.float)
    assert torch.equal(counts, expected)
    assert torch.equal(base, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_running_counts_without_tokens_or_base():
    base = torch.tensor([0.0, 3.0])
    assert torch.equal(running_counts(base, torch.tensor([], dtype=torch.long), 2), base[None])
    assert running_counts(None, torch.tensor([1]), 2) is None
