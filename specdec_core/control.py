"""Adaptive gamma and the speculative/plain decision, as one choice.

Each step picks the gamma in [0, gamma_max] (0 is plain decoding) that
maximises expected tokens per second for the batch: the sum over rows of
expected tokens per pass at each row's acceptance, over the measured time of
gamma draft steps plus one verify pass of B * (gamma + 1) tokens. Costs are
measured online. A cost never measured is assumed equal to the nearest
smaller measured one, so the controller tries it once and then knows; that
is how it finds by itself where large batches make speculation a loss.
"""

from __future__ import annotations

import bisect
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
        """The measured cost at `size`, else the nearest smaller measured one (optimistic), else the smallest."""
        if size in self.seconds:
            return self.seconds[size]
        sizes = sorted(self.seconds)
        if not sizes:
            return None
        below = bisect.bisect_right(sizes, size) - 1
        return self.seconds[sizes[max(below, 0)]]


@dataclass
class Controller:
    """Chooses each step's gamma from measured acceptance and measured costs."""

    gamma_max: int = 5
    fixed_gamma: int | None = None  # set: always this gamma (still bounded by max_speculative_batch)
    max_speculative_batch: int = 64  # batches larger than this always decode plainly
    prior_weight: float = 8.0  # how many draft tokens the method-wide acceptance counts as, per request
    verify: CostTable = field(default_factory=CostTable)  # key: tokens in the pass (batch * width)
    draft: CostTable = field(default_factory=CostTable)  # key: batch size; seconds per draft step
    method_drafted: int = 0
    method_accepted: int = 0

    @property
    def method_alpha(self) -> float:
        # Before any measurement assume acceptance is good enough to try speculating.
        return (self.method_accepted + 4) / (self.method_drafted + 5)

    def alpha(self, seq: Sequence) -> float:
        """The request's acceptance, shrunk toward the method-wide rate while it has few samples."""
        stats = seq.stats
        alpha = (stats.accepted_tokens + self.prior_weight * self.method_alpha) / (stats.draft_tokens + self.prior_weight)
        return min(alpha, 0.999)

    def choose(self, seqs: list[Sequence]) -> int:
        batch = len(seqs)
        if batch == 0 or batch > self.max_speculative_batch:
            return 0
        cap = min(self.gamma_max, max(seq.remaining for seq in seqs) - 1)
        if self.fixed_gamma is not None:
            return max(min(self.fixed_gamma, cap), 0)
        plain = self.verify.estimate(batch)
        if plain is None:
            return 0  # measure a plain step first
        alphas = [self.alpha(seq) for seq in seqs]
        best_gamma, best_rate = 0, batch / plain
        for gamma in range(1, cap + 1):
            draft = self.draft.estimate(batch) or 0.0
            seconds = gamma * draft + self.verify.estimate(batch * (gamma + 1))
            rate = sum(expected_tokens(a, gamma) for a in alphas) / seconds
            if rate > best_rate:
                best_gamma, best_rate = gamma, rate
        return best_gamma

    def observe(self, batch: int, width: int, verify_s: float, gamma: int, draft_s: float, drafted: int, accepted: int) -> None:
        """Record one step: its verify pass, its drafting, and the acceptance it got."""
        self.verify.observe(batch * width, verify_s)
        if gamma:
            self.draft.observe(batch, draft_s / gamma)
        self.method_drafted += drafted
        self.method_accepted += accepted
