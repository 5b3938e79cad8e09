"""Adaptive gamma and the speculative/plain decision, as one choice.

Each step picks the gamma in [0, gamma_max] (0 is plain decoding) that
maximises expected tokens per second for the batch: the sum over rows of
expected tokens per pass, over the measured time of gamma draft steps plus one
verify pass of B * (gamma + 1) tokens. Three measurements feed it:

- Costs, measured online per pass size. A size never measured is given the
  lowest cost its measured neighbours allow (a pass never costs less for more
  tokens, nor more per token), so the controller tries a larger pass once and
  then knows, without re-trying every size in between as a batch shrinks.
- Each row's per-token acceptance alpha: accepted tokens over accepted tokens
  plus rejections, the estimate that fits the chain model's
  (1 - alpha^(gamma+1)) / (1 - alpha). Accepted over drafted would count the
  tokens after a rejection, which were never tried, and on drafts that are
  right or wrong in runs (a draft model's) it underrates long drafts.
- Each row's fill: the share of the draft tokens asked of it that its drafter
  proposed. An n-gram drafter proposes nothing for a row with no match; such a
  row gains nothing from the step, and when no row drafts the step is plain.

Acceptance and fill are shrunk toward the method-wide figures while a row has
few samples.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from .sequence import Sequence
from .theory import expected_tokens


@dataclass
class CostTable:
    """Exponential moving averages of seconds, keyed by an integer size."""

    decay: float = 0.8
    seconds: dict[int, float] = field(default_factory=dict)

    def observe(self, size: int, elapsed: float) -> None:
        old = self.seconds.get(size)
        self.seconds[size] = elapsed if old is None else self.decay * old + (1 - self.decay) * elapsed

    def estimate(self, size: int) -> float | None:
        """The measured cost at `size`; else the lowest cost the measured sizes around it allow.

        A pass costs no less for more tokens (so at least the nearest smaller size's cost) and no more per
        token (so at least size / larger * the nearest larger size's cost). Optimistic, so an unmeasured size
        gets tried once, but never below what a larger measured pass implies.
        """
        if size in self.seconds:
            return self.seconds[size]
        sizes = sorted(self.seconds)
        if not sizes:
            return None
        at = bisect.bisect_right(sizes, size)
        bounds = []
        if at > 0:
            bounds.append(self.seconds[sizes[at - 1]])
        if at < len(sizes):
            bounds.append(self.seconds[sizes[at]] * size / sizes[at])
        return max(bounds)


@dataclass
class RowTally:
    """What the controller has seen of one sequence: every step since it joined."""

    seq: Sequence
    asking: int = 0  # draft tokens the step in progress asks of it (gamma, capped by its tokens left)
    asked: int = 0  # draft tokens the finished steps asked of it
    drafted: int = 0  # draft tokens it proposed
    accepted: int = 0  # of those, the ones the target kept
    rejections: int = 0  # verify steps that rejected one of its draft tokens


@dataclass
class Controller:
    """Chooses each step's gamma from measured acceptance, measured fill and measured costs."""

    gamma_max: int = 5
    fixed_gamma: int | None = None  # set: always this gamma (still bounded by max_speculative_batch)
    max_speculative_batch: int = 64  # batches larger than this always decode plainly
    prior_weight: float = 8.0  # how many draft tokens the method-wide figures count as, per request
    verify: CostTable = field(default_factory=CostTable)  # key: tokens in the pass (batch * width)
    draft: CostTable = field(default_factory=CostTable)  # key: batch size; seconds per draft step
    method_drafted: int = 0
    method_accepted: int = 0
    method_asked: int = 0
    method_rejections: int = 0
    rows: dict[int, RowTally] = field(default_factory=dict)  # by id(seq): the rows of the step in progress

    @property
    def method_alpha(self) -> float:
        # Before any measurement assume acceptance is good enough to try speculating.
        return (self.method_accepted + 4) / (self.method_accepted + self.method_rejections + 5)

    @property
    def method_fill(self) -> float:
        # Before any measurement assume the drafter proposes what it is asked for.
        return (self.method_drafted + 1) / (self.method_asked + 1)

    def alpha(self, seq: Sequence) -> float:
        """The request's acceptance per tried draft token, shrunk toward the method-wide rate while it has few samples."""
        row = self._row(seq)
        alpha = (row.accepted + self.prior_weight * self.method_alpha) / (row.accepted + row.rejections + self.prior_weight)
        return min(alpha, 0.999)

    def fill(self, seq: Sequence) -> float:
        """The share of asked draft tokens the request's drafter proposed, shrunk toward the method-wide share."""
        row = self._row(seq)
        return min((row.drafted + self.prior_weight * self.method_fill) / (row.asked + self.prior_weight), 1.0)

    def choose(self, seqs: list[Sequence]) -> int:
        gamma = self._decide(seqs)
        self.rows = {id(seq): self._row(seq) for seq in seqs}  # rows that left are forgotten
        for row in self.rows.values():
            row.asking = min(gamma, row.seq.draft_budget)  # the engine trims drafts to that
        return gamma

    def _decide(self, seqs: list[Sequence]) -> int:
        batch = len(seqs)
        if batch == 0 or batch > self.max_speculative_batch:
            return 0
        cap = min(self.gamma_max, max(seq.draft_budget for seq in seqs))
        if self.fixed_gamma is not None:
            return max(min(self.fixed_gamma, cap), 0)
        plain = self.verify.estimate(batch)
        if plain is None:
            return 0  # measure a plain step first
        alphas = [self.alpha(seq) for seq in seqs]
        fills = [self.fill(seq) if seq.speculate else 0.0 for seq in seqs]
        # A step in which no row drafts is a plain step, whatever gamma was asked.
        none_drafts = math.prod(1 - f for f in fills)
        best_gamma, best_rate = 0, batch / plain
        for gamma in range(1, cap + 1):
            tokens = sum(1 + f * (expected_tokens(a, gamma) - 1) for a, f in zip(alphas, fills))
            verify = (1 - none_drafts) * self.verify.estimate(batch * (gamma + 1)) + none_drafts * plain
            rate = tokens / (gamma * (self.draft.estimate(batch) or 0.0) + verify)
            if rate > best_rate:
                best_gamma, best_rate = gamma, rate
        return best_gamma

    def _row(self, seq: Sequence) -> RowTally:
        row = self.rows.get(id(seq))
        # A new row starts with no samples. An id can be reused once its sequence is gone, hence the identity check.
        return row if row is not None and row.seq is seq else RowTally(seq)

    def observe(
        self, batch: int, width: int, verify_s: float, gamma: int, draft_s: float, rows: Iterable[tuple[Sequence, int, int]]
    ) -> None:
        """Record one step: its verify pass, its drafting, and per row (sequence, draft tokens, kept draft tokens)."""
        self.verify.observe(batch * width, verify_s)
        if gamma:
            self.draft.observe(batch, draft_s / gamma)
        for row in self.rows.values():  # the step in progress is done: what it asked is asked
            row.asked += row.asking
            self.method_asked += row.asking
            row.asking = 0
        for seq, drafted, accepted in rows:
            row = self.rows[id(seq)] = self._row(seq)
            rejected = accepted < drafted
            row.drafted += drafted
            row.accepted += accepted
            row.rejections += rejected
            self.method_drafted += drafted
            self.method_accepted += accepted
            self.method_rejections += rejected
