"""The acceptance rules in isolation: greedy matching and chain rejection sampling."""

import pytest
import torch
from scipy import stats

from specdec_core.sampling import make_generator, sample
from specdec_core.verify import verify_greedy, verify_sampled

CPU = torch.device("cpu")


def tokens(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


@pytest.mark.parametrize(
    "draft, target, accepted, emitted",
    [
        ((5, 6, 7), (5, 6, 7, 8), 3, [5, 6, 7, 8]),  # all kept: the target's token after them is the bonus
        ((5, 6, 7), (5, 9, 7, 8), 1, [5, 9]),  # first mismatch: the target's own token replaces it
        ((5, 6, 7), (1, 6, 7, 8), 0, [1]),
        ((5, 6, 7), (5, 6, 1, 8), 2, [5, 6, 1]),
        ((), (4,), 0, [4]),  # no draft: plain decoding
    ],
)
def test_verify_greedy(draft, target, accepted, emitted):
    assert verify_greedy(tokens(*draft), tokens(*target)) == (accepted, emitted)


def dist(*weights: float) -> torch.Tensor:
    t = torch.tensor(weights)
    return t / t.sum()


P = torch.stack([dist(6, 3, 1, 0), dist(1, 1, 1, 1), dist(0, 0, 1, 3)])  # p [3, V]: after 0, 1 and 2 draft tokens
SEEDS = range(200)


def test_p_equal_q_accepts_every_draft_and_draws_the_bonus_from_p():
    draft, q = tokens(0, 3), P[:2]
    for seed in SEEDS:
        accepted, emitted = verify_sampled(draft, q, P, make_generator(seed, CPU))
        assert accepted == 2 and emitted[:2] == [0, 3]
        assert emitted[2] in (2, 3)  # support of p[2]


def test_token_with_certain_target_probability_is_always_kept_under_one_hot_q():
    p = torch.stack([torch.eye(4)[1], dist(1, 1, 1, 1)])
    for seed in SEEDS:
        accepted, emitted = verify_sampled(tokens(1), None, p, make_generator(seed, CPU))
        assert accepted == 1 and emitted[0] == 1


def test_token_the_target_never_draws_is_always_replaced():
    # p[0](3) = 0: the first draft token is rejected whatever q gave it, and the rest is discarded.
    for q in (None, torch.stack([dist(1, 1, 1, 1), dist(1, 1, 1, 1)])):
        for seed in SEEDS:
            accepted, emitted = verify_sampled(tokens(3, 0), q, P, make_generator(seed, CPU))
            assert accepted == 0 and len(emitted) == 1
            assert emitted[0] in (0, 1, 2)  # the residual never gives back the rejected token


def test_rejection_after_an_accepted_prefix():
    q = torch.stack([P[0], dist(0, 0, 0, 1)])  # position 0 matches p exactly, position 1 proposes 3 where p is 1/4
    outcomes = [verify_sampled(tokens(0, 3), q, P, make_generator(seed, CPU)) for seed in SEEDS]
    for accepted, emitted in outcomes:
        assert emitted[0] == 0 and len(emitted) == accepted + 1
        if accepted == 1:
            assert emitted[1] in (0, 1, 2)  # residual max(0, p - q) at position 1 excludes token 3
    assert {accepted for accepted, _ in outcomes} == {1, 2}


@pytest.mark.parametrize(
    "q, draft, expected",
    [
        # Deterministic draft 1 (q one-hot): kept with p(1); the residual is p without 1, so the output is p.
        (None, 1, dist(6, 3, 1, 0)),
        # Fixed draft 1 with q(1) = 0.9: kept with p/q = 1/3; residual norm(max(0, p - q)) = [.5, 0, .1, 0] / .6.
        (dist(1, 9, 0, 0), 1, torch.tensor([2 / 3 * 5 / 6, 1 / 3, 2 / 3 * 1 / 6, 0])),
    ],
)
def test_first_token_distribution_for_a_fixed_draft(q, draft, expected):
    q = q[None] if q is not None else None
    counts = torch.zeros(4)
    for seed in range(8000):
        counts[verify_sampled(tokens(draft), q, P[:2], make_generator(seed, CPU))[1][0]] += 1
    assert_matches(counts, expected)


def test_first_token_is_distributed_as_p_when_the_draft_is_drawn_from_q():
    """The theorem itself: draft x ~ q, keep with min(1, p/q), else residual; the first token is ~ p."""
    q = dist(1, 9, 3, 5)  # q gives mass where p has none and little where p has most
    counts = torch.zeros(4)
    for seed in range(8000):
        generator = make_generator(seed, CPU)
        draft = sample(q[None], generator)
        counts[verify_sampled(draft, q[None], P[:2], generator)[1][0]] += 1
    assert_matches(counts, P[0])


def assert_matches(counts: torch.Tensor, expected: torch.Tensor) -> None:
    support = expected > 0
    assert counts[~support].sum() == 0, f"tokens outside the support were drawn: {counts}"
    observed, expect = counts[support], expected[support] * counts.sum()
    assert stats.chisquare(observed.numpy(), expect.numpy()).pvalue > 1e-3, (counts, expected)
