"""The controller: gamma (0 is plain) from measured acceptance and measured costs.

Costs are fed through `observe` exactly as the engine reports them, from cost
models rather than clocks, so every choice is deterministic.
"""

import random

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


def simulate(controller: Controller, seqs: list[Sequence], verify_cost, acceptance: float, steps: int) -> list[int]:
    """Run `steps` engine-like steps: choose, draft, verify (each draft token kept with `acceptance`), observe."""
    rng = random.Random(0)
    chosen = []
    for _ in range(steps):
        gamma = controller.choose(seqs)
        chosen.append(gamma)
        accepted = 0
        for seq in seqs:
            kept = sum(rng.random() < acceptance for _ in range(gamma))
            seq.stats.draft_tokens += gamma
            seq.stats.accepted_tokens += kept
            accepted += kept
        verify_s = verify_cost(len(seqs) * (gamma + 1))
        controller.observe(len(seqs), gamma + 1, verify_s, gamma, gamma * DRAFT_S, len(seqs) * gamma, accepted)
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
    controller.observe(1, 1, VERIFY_S, 0, 0.0, 0, 0)
    assert controller.choose(batch(1)) > 0  # no acceptance measured yet: optimistic


def test_request_acceptance_is_shrunk_toward_the_method_rate():
    controller = Controller(prior_weight=8.0)
    controller.observe(1, 3, VERIFY_S, 2, DRAFT_S, drafted=995, accepted=196)  # method rate (196 + 4) / (995 + 5) = 0.2
    fresh, measured = batch(2)
    assert controller.alpha(fresh) == pytest.approx(0.2)
    measured.stats.draft_tokens, measured.stats.accepted_tokens = 1000, 900
    assert controller.alpha(measured) == pytest.approx((900 + 8 * 0.2) / 1008)
    measured.stats.draft_tokens = measured.stats.accepted_tokens = 10**6
    assert controller.alpha(measured) == 0.999  # capped below 1: expected tokens stay finite


def test_cost_table_estimates():
    table = CostTable(decay=0.5)
    assert table.estimate(4) is None
    table.observe(4, 1.0)
    table.observe(4, 3.0)
    table.observe(16, 8.0)
    assert table.estimate(4) == 2.0  # moving average
    assert table.estimate(8) == 2.0  # unmeasured: the nearest smaller measured size
    assert table.estimate(64) == 8.0
    assert table.estimate(1) == 2.0  # below every measured size: the smallest
