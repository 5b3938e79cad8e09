"""The controller: gamma (0 is plain) from measured acceptance and measured costs.

Costs are fed through `observe` exactly as the engine reports them, from cost
models rather than clocks, so every choice is deterministic.
"""

import random
from collections.abc import Callable

import pytest

from specdec_core.control import Controller, CostTable
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence
from specdec_core.theory import optimal_gamma, speedup

VERIFY_S = 0.01  # one plain pass
DRAFT_S = 0.0005  # one draft step: cost ratio 0.05


def flat(tokens: int) -> float:
    """Memory-bound: a pass costs the same for any number of tokens."""
    return VERIFY_S


def linear(tokens: int) -> float:
    """Compute-bound: a pass costs in proportion to its tokens."""
    return VERIFY_S * tokens


def batch(size: int, max_tokens: int = 1000) -> list[Sequence]:
    return [Sequence(f"r{i}", [1, 2, 3], SamplingParams(), max_tokens) for i in range(size)]


def simulate(
    controller: Controller, seqs: list[Sequence], verify_cost, acceptance: float, steps: int,
    drafting: Callable[[int], bool] = lambda row: True, in_runs: bool = False,
) -> list[int]:
    """Run `steps` engine-like steps: choose, draft, verify, observe; returns the gammas chosen.

    Rows for which `drafting(row)` is false propose nothing (an n-gram drafter without a match). A draft is
    kept up to its first rejection, each token with `acceptance`; `in_runs`: all of it or none of it, with
    `acceptance` (a drafter that is right or wrong for stretches of text).
    """
    rng = random.Random(0)
    chosen = []
    for _ in range(steps):
        gamma = controller.choose(seqs)
        chosen.append(gamma)
        lengths = [gamma if drafting(i) else 0 for i in range(len(seqs))]
        rows = []
        for seq, length in zip(seqs, lengths):
            if in_runs:
                kept = length if rng.random() < acceptance else 0
            else:
                kept = next((j for j in range(length) if rng.random() >= acceptance), length)
            rows.append((seq, length, kept))
        width = max(lengths)
        verify_s = verify_cost(len(seqs) * (width + 1))
        controller.observe(len(seqs), width + 1, verify_s, width, width * DRAFT_S, rows)
    return chosen


def test_compute_bound_verification_drives_the_controller_to_plain_by_itself():
    controller, seqs = Controller(gamma_max=5), batch(4)
    chosen = simulate(controller, seqs, linear, acceptance=0.8, steps=30)
    assert chosen[0] == 0  # a plain step is measured first
    assert max(chosen) > 0  # it tried speculating: unmeasured costs look like measured smaller ones
    assert chosen[-10:] == [0] * 10  # and, having measured the cost, gave it up


def test_flat_verification_and_cheap_drafts_pick_the_theoretical_optimum():
    controller, seqs = Controller(gamma_max=5), batch(4)
    chosen = simulate(controller, seqs, flat, acceptance=0.6, steps=30)
    assert min(chosen[-10:]) > 0
    gamma = controller.choose(seqs)
    assert 0 < gamma < 5  # an interior optimum: neither plain nor as long as allowed
    # Rows differ in measured acceptance; the batch's best gamma maximises their summed speedup.
    alphas = [controller.alpha(seq) for seq in seqs]
    assert gamma == max(range(6), key=lambda g: sum(speedup(a, g, DRAFT_S / VERIFY_S) for a in alphas))


def test_single_row_with_flat_verification_picks_optimal_gamma():
    controller, seqs = Controller(gamma_max=8), batch(1)
    simulate(controller, seqs, flat, acceptance=0.7, steps=30)
    gamma = controller.choose(seqs)
    assert 0 < gamma < 8
    assert gamma == optimal_gamma(controller.alpha(seqs[0]), DRAFT_S / VERIFY_S, gamma_max=8)[0]


def test_low_acceptance_drives_the_controller_to_plain():
    controller, seqs = Controller(gamma_max=5), batch(2)
    chosen = simulate(controller, seqs, flat, acceptance=0.0, steps=30)
    assert max(chosen) > 0
    assert chosen[-10:] == [0] * 10
    assert controller.alpha(seqs[0]) < 0.1


@pytest.mark.parametrize("verify_cost", [flat, linear])
def test_fixed_gamma_is_honoured_whatever_the_costs(verify_cost):
    controller, seqs = Controller(gamma_max=5, fixed_gamma=3), batch(4)
    assert simulate(controller, seqs, verify_cost, acceptance=0.0, steps=10) == [3] * 10


def test_gamma_never_exceeds_the_tokens_left():
    assert Controller(fixed_gamma=3).choose(batch(2, max_tokens=3)) == 2
    assert Controller(fixed_gamma=3).choose(batch(2, max_tokens=1)) == 0
    # The row with the most tokens left sets the cap; the engine trims the others.
    assert Controller(fixed_gamma=3).choose(batch(1, max_tokens=2) + batch(1, max_tokens=50)) == 3


@pytest.mark.parametrize("fixed_gamma", [None, 3])
def test_batches_above_max_speculative_batch_decode_plainly(fixed_gamma):
    controller = Controller(gamma_max=5, fixed_gamma=fixed_gamma, max_speculative_batch=4)
    simulate(controller, batch(4), flat, acceptance=0.8, steps=10)
    for size in (5, 6):
        simulate(controller, batch(size), flat, acceptance=0.8, steps=10)  # measure these sizes too
    assert controller.choose(batch(4)) > 0
    assert controller.choose(batch(5)) == 0
    assert controller.choose([]) == 0


def test_plain_first_until_a_plain_step_is_measured():
    controller = Controller()
    assert controller.choose(batch(1)) == 0
    controller.observe(1, 1, VERIFY_S, 0, 0.0, rows=[])
    assert controller.choose(batch(1)) > 0  # no acceptance measured yet: optimistic


def test_acceptance_counts_tokens_up_to_the_first_rejection_and_is_shrunk_toward_the_method_rate():
    controller, seqs = Controller(fixed_gamma=4), batch(4)
    simulate(controller, seqs, flat, acceptance=0.5, steps=300)
    # Accepted over drafted would be about 0.23: the tokens after a rejection are drafted but never tried.
    assert controller.method_alpha == pytest.approx(0.5, abs=0.03)
    (fresh,) = batch(1)
    assert controller.alpha(fresh) == pytest.approx(controller.method_alpha)  # no samples of its own yet
    perfect = batch(1)
    simulate(controller, perfect, flat, acceptance=1.0, steps=100)
    assert controller.alpha(perfect[0]) > 0.98  # its own 400 accepted tokens outweigh the method's rate
    simulate(controller, perfect, flat, acceptance=1.0, steps=10_000)
    assert controller.alpha(perfect[0]) == 0.999  # capped below 1: expected tokens stay finite


def test_a_shrinking_compute_bound_batch_is_not_explored_again_at_every_size():
    controller, seqs = Controller(gamma_max=5), batch(8)
    simulate(controller, seqs, linear, acceptance=0.8, steps=20)
    # Rows finish one by one. Every new pass size lies between measured ones, and a pass costs no less per
    # token for fewer tokens: none is worth trying (before, each looked as cheap as the nearest smaller one).
    chosen = [g for rows in range(7, 0, -1) for g in simulate(controller, seqs[:rows], linear, acceptance=0.8, steps=3)]
    assert chosen == [0] * len(chosen)


def test_drafts_right_or_wrong_in_runs_get_the_long_gamma_they_pay_for():
    # All of a draft is kept or none of it: tokens per step 1 + 0.6 gamma, cost 1 + 0.05 gamma: longest is best.
    # Accepted over drafted (0.6) in the chain formula would make gamma 3 look best and lose a sixth.
    controller, seqs = Controller(gamma_max=5), batch(1)
    chosen = simulate(controller, seqs, flat, acceptance=0.6, steps=200, in_runs=True)
    assert chosen[-20:] == [5] * 20


def slightly_compute_bound(tokens: int) -> float:
    return VERIFY_S * (1 + 0.1 * (tokens - 1))


def test_rows_whose_drafter_proposes_nothing_gain_nothing_from_speculating():
    # One row of four has n-gram matches: its gain does not pay for the other three rows' longer pass.
    controller, seqs = Controller(gamma_max=5), batch(4)
    chosen = simulate(controller, seqs, slightly_compute_bound, acceptance=0.8, steps=60, drafting=lambda row: row == 0)
    assert chosen[-20:] == [0] * 20
    assert controller.fill(seqs[1]) < 0.3 < controller.fill(seqs[0])
    # When all four draft, the same costs make speculation pay.
    controller, seqs = Controller(gamma_max=5), batch(4)
    chosen = simulate(controller, seqs, slightly_compute_bound, acceptance=0.8, steps=60)
    assert min(chosen[-20:]) > 0


def test_cost_table_estimates():
    table = CostTable(decay=0.5)
    assert table.estimate(4) is None
    table.observe(4, 1.0)
    table.observe(4, 3.0)
    table.observe(16, 4.0)
    assert table.estimate(4) == 2.0  # moving average
    # Unmeasured: the lowest cost the neighbours allow: no less than the smaller pass, no less per token than the larger.
    assert table.estimate(6) == 2.0
    assert table.estimate(12) == 3.0
    assert table.estimate(64) == 4.0  # beyond every measured size: the largest (tried once, then known)
    assert table.estimate(1) == 0.5  # below every measured size: the smallest's cost per token
