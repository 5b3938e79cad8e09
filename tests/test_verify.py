"""The acceptance rules in isolation: greedy matching and chain rejection sampling, a batch of rows at once."""

import pytest
import torch
from scipy import stats

from specdec_core.sampling import make_generator, sample
from specdec_core.verify import accept_chains_greedy, accept_chains_sampled

CPU = torch.device("cpu")


def tokens(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def kept(accepted, row: int = 0) -> tuple[int, list[int]]:
    """(accepted, emitted tokens) of one row of a batched result."""
    n = int(accepted.counts[row])
    return n, accepted.tokens[row, : n + 1].tolist()


GREEDY = [
    ((5, 6, 7), (5, 6, 7, 8), 3, [5, 6, 7, 8]),  # all kept: the target's token after them is the bonus
    ((5, 6, 7), (5, 9, 7, 8), 1, [5, 9]),  # first mismatch: the target's own token replaces it
    ((5, 6, 7), (1, 6, 7, 8), 0, [1]),
    ((5, 6, 7), (5, 6, 1, 8), 2, [5, 6, 1]),
    ((), (4,), 0, [4]),  # no draft: plain decoding
]


@pytest.mark.parametrize("draft, target, accepted, emitted", GREEDY)
def test_greedy_chain(draft, target, accepted, emitted):
    assert kept(accept_chains_greedy(tokens(*draft)[None], [len(draft)], tokens(*target)[None])) == (accepted, emitted)


def test_a_row_of_a_batch_is_judged_on_its_own_length():
    # Row 1 drafted one token; its padding would match the target, but is not a draft.
    drafts, targets = tokens(5, 6, 7).expand(2, -1), tokens(5, 6, 7, 8).expand(2, -1)
    result = accept_chains_greedy(drafts, [3, 1], targets)
    assert kept(result, 0) == (3, [5, 6, 7, 8]) and kept(result, 1) == (1, [5, 6])


def dist(*weights: float) -> torch.Tensor:
    t = torch.tensor(weights)
    return t / t.sum()


P = torch.stack([dist(6, 3, 1, 0), dist(1, 1, 1, 1), dist(0, 0, 1, 3)])  # p [3, V]: after 0, 1 and 2 draft tokens
SEEDS = range(200)


def sampled(draft: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, seeds, generators=None) -> list[tuple[int, list[int]]]:
    """One draft [g] (or one per row [rows, g]) against p and q as a batch of len(seeds) rows, row i drawing from seed
    i (or generators[i])."""
    rows = len(seeds)
    generators = generators or [make_generator(seed, CPU) for seed in seeds]
    drafts = draft.expand(rows, -1) if draft.dim() == 1 else draft
    result = accept_chains_sampled(
        drafts, [drafts.shape[1]] * rows, p.expand(rows, -1, -1), None if q is None else q.expand(rows, -1, -1), generators,
    )
    return [kept(result, i) for i in range(rows)]


def test_p_equal_q_accepts_every_draft_and_draws_the_bonus_from_p():
    for accepted, emitted in sampled(tokens(0, 3), P[:2], P, SEEDS):
        assert accepted == 2 and emitted[:2] == [0, 3]
        assert emitted[2] in (2, 3)  # support of p[2]


def test_token_with_certain_target_probability_is_always_kept_under_one_hot_q():
    p = torch.stack([torch.eye(4)[1], dist(1, 1, 1, 1)])
    for accepted, emitted in sampled(tokens(1), None, p, SEEDS):
        assert accepted == 1 and emitted[0] == 1


def test_token_the_target_never_draws_is_always_replaced():
    # p[0](3) = 0: the first draft token is rejected whatever q gave it, and the rest is discarded.
    for q in (None, torch.stack([dist(1, 1, 1, 1), dist(1, 1, 1, 1)])):
        for accepted, emitted in sampled(tokens(3, 0), q, P, SEEDS):
            assert accepted == 0 and len(emitted) == 1
            assert emitted[0] in (0, 1, 2)  # the residual never gives back the rejected token


def test_rejection_after_an_accepted_prefix():
    q = torch.stack([P[0], dist(0, 0, 0, 1)])  # position 0 matches p exactly, position 1 proposes 3 where p is 1/4
    outcomes = sampled(tokens(0, 3), q, P, SEEDS)
    for accepted, emitted in outcomes:
        assert emitted[0] == 0 and len(emitted) == accepted + 1
        if accepted == 1:
            assert emitted[1] in (0, 1, 2)  # residual max(0, p - q) at position 1 excludes token 3
    assert {accepted for accepted, _ in outcomes} == {1, 2}


def test_a_row_draws_one_uniform_per_draft_token_then_one_token_from_its_own_generator():
    """The draw order a seed fixes: rand(g), then one multinomial draw; rows of other lengths beside it change nothing."""
    q = torch.stack([P[0], dist(0, 0, 0, 1)])
    drafts, lengths = torch.tensor([[0, 3], [1, 0], [0, 3]]), [2, 1, 0]
    p, qs = P.expand(3, -1, -1), q.expand(3, -1, -1)
    for seed in range(50):
        result = accept_chains_sampled(drafts, lengths, p, qs, [make_generator(seed + k, CPU) for k in range(3)])
        for row, (draft, length) in enumerate(zip(drafts, lengths)):
            generator = make_generator(seed + row, CPU)
            u = torch.rand(length, generator=generator)
            rejected = [j for j in range(length) if u[j] * q[j, draft[j]] >= P[j, draft[j]]]
            n = rejected[0] if rejected else length
            after = (P[n] - q[n]).clamp_min(0) if rejected else P[n]
            last = int(sample((after / after.sum())[None], generator))
            assert kept(result, row) == (n, draft[:n].tolist() + [last])


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
    for _, emitted in sampled(tokens(draft), q, P[:2], range(8000)):
        counts[emitted[0]] += 1
    assert_matches(counts, expected)


def test_first_token_is_distributed_as_p_when_the_draft_is_drawn_from_q():
    """The theorem itself: draft x ~ q, keep with min(1, p/q), else residual; the first token is ~ p."""
    q = dist(1, 9, 3, 5)  # q gives mass where p has none and little where p has most
    generators = [make_generator(seed, CPU) for seed in range(8000)]
    drafts = torch.stack([sample(q[None], generator) for generator in generators])  # [rows, 1]
    counts = torch.zeros(4)
    for _, emitted in sampled(drafts, q[None], P[:2], range(8000), generators):
        counts[emitted[0]] += 1
    assert_matches(counts, P[0])


def assert_matches(counts: torch.Tensor, expected: torch.Tensor) -> None:
    support = expected > 0
    assert counts[~support].sum() == 0, f"tokens outside the support were drawn: {counts}"
    observed, expect = counts[support], expected[support] * counts.sum()
    assert stats.chisquare(observed.numpy(), expect.numpy()).pvalue > 1e-3, (counts, expected)
