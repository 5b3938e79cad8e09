"""Closed forms: expected tokens per pass, speedup, optimal gamma."""

import pytest

from specdec_core.theory import expected_tokens, optimal_gamma, speedup

GRID = [i / 20 for i in range(20)]  # alphas and cost ratios 0 .. 0.95


def test_expected_tokens_known_values():
    assert round(expected_tokens(0.75, 5), 2) == 3.29
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.0, 7) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.9, 0) == pytest.approx(1.0)


@pytest.mark.parametrize("alpha", [-0.1, 1.5])
def test_expected_tokens_rejects_alpha_outside_unit_interval(alpha):
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens(alpha, 3)


@pytest.mark.parametrize("alpha", GRID)
def test_expected_tokens_is_the_geometric_sum(alpha):
    for gamma in range(8):
        assert expected_tokens(alpha, gamma) == pytest.approx(sum(alpha**i for i in range(gamma + 1)))


def test_speedup_properties():
    assert speedup(0.8, 0, 0.3) == 1.0  # gamma 0 is plain decoding
    assert speedup(0.8, 3, 0.0) == pytest.approx(expected_tokens(0.8, 3))  # free drafts: tokens per pass
    assert speedup(0.8, 3, 0.1) > speedup(0.8, 3, 0.2)  # dearer drafts, less speedup
    assert speedup(0.9, 3, 0.1) > speedup(0.8, 3, 0.1)  # better acceptance, more speedup
    # Compute-bound: verifying gamma+1 tokens costs gamma+1 plain passes, so speculation never pays.
    for alpha in GRID:
        for gamma in range(1, 8):
            assert speedup(alpha, gamma, 0.0, verify_ratio=gamma + 1) < 1.0


def test_optimal_gamma_is_the_best_of_all_gammas():
    for alpha in GRID:
        for c in GRID:
            gamma, best = optimal_gamma(alpha, c, gamma_max=12)
            assert best == speedup(alpha, gamma, c)
            assert all(speedup(alpha, g, c) <= best for g in range(13))


def test_speculation_pays_exactly_when_acceptance_beats_the_cost_ratio():
    # (1 - a^(g+1)) / (1 - a) <= 1 + g c whenever a <= c, and gamma 1 wins whenever a > c.
    for alpha in GRID:
        for c in GRID:
            if alpha != c:
                assert (optimal_gamma(alpha, c)[0] > 0) == (alpha > c), (alpha, c)
    # A verify pass twice as dear as a plain one caps tokens per second below plain at alpha 0.5.
    assert optimal_gamma(0.5, 0.1, verify_ratio=2.0) == (0, 1.0)
    assert optimal_gamma(0.9, 0.1, verify_ratio=2.0)[0] > 0


def test_optimal_gamma_grows_with_acceptance_and_shrinks_with_cost():
    for c in GRID:
        gammas = [optimal_gamma(alpha, c)[0] for alpha in GRID]
        assert gammas == sorted(gammas)
    for alpha in GRID:
        gammas = [optimal_gamma(alpha, c)[0] for c in GRID]
        assert gammas == sorted(gammas, reverse=True)
    assert optimal_gamma(0.8, 0.0, gamma_max=10)[0] == 10  # free drafts: as long as allowed
    assert optimal_gamma(0.99, 0.001, gamma_max=4)[0] == 4
