"""The measurement design and its statistics: interleaving, per-block ratios, summaries.

Timings on a shared machine drift by more than the effects being measured
(see MODELS.md: 12% between sittings), so methods are never compared across
time. Every block (one prompt, or one batch) runs plain decoding next to
every other method, and each method's throughput is divided by that of the
plain runs around it in time. Linear drift cancels when a run is
bracketed by two plain runs next to it; it nearly cancels with plain runs further off.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence

PLAIN = "plain"


def interleave(methods: Sequence[str], plain_every: int = 1, rotate: int = 0) -> list[str]:
    """The run order of one block: plain, then `plain_every` methods, then plain again, ..., ending in plain.

    plain_every=1 brackets every method by two plain runs; N above 1 runs N
    methods between two plain runs, fewer plain runs for a coarser correction of drift. `rotate` shifts the method
    order from block to block so that no method always runs first or last.
    """
    if plain_every < 1:
        raise ValueError("plain_every must be at least 1")
    others = [m for m in methods if m != PLAIN]
    if not others:
        return [PLAIN]
    shift = rotate % len(others)
    others = others[shift:] + others[:shift]
    order = []
    for start in range(0, len(others), plain_every):
        order.append(PLAIN)
        order.extend(others[start : start + plain_every])
    order.append(PLAIN)
    return order


def ratios_to_plain(labels: Sequence[str], rates: Sequence[float | None]) -> list[float | None]:
    """Each run's throughput over plain's nearest to it in time, for the runs of one block in order.

    A method's run is divided by the mean of the nearest plain run before it and the nearest after it
    (one where the block has plain on one side only): with `plain_every` above 2 some methods have no
    plain run next to them, and they are still measured against the plain runs around them. A plain run
    is divided by the previous plain run: the spread of those ratios around 1.0 is the noise floor of the
    whole measurement. A run without a rate (None) gets no ratio.
    """
    plain = [i for i, label in enumerate(labels) if label == PLAIN and rates[i]]
    ratios: list[float | None] = []
    previous_plain: float | None = None
    for i, (label, rate) in enumerate(zip(labels, rates)):
        if label == PLAIN:
            ratios.append(rate / previous_plain if rate and previous_plain else None)
            previous_plain = rate
            continue
        nearest = bisect.bisect(plain, i)  # plain[nearest - 1] runs last before i, plain[nearest] first after
        neighbours = [rates[j] for j in plain[max(nearest - 1, 0) : nearest + 1]]
        ratios.append(rate / statistics.fmean(neighbours) if rate and neighbours else None)
    return ratios


def summary(values: Sequence[float | None]) -> dict | None:
    """Median, mean, range and count of the values that exist; None when none do."""
    present = [v for v in values if v is not None and not math.isnan(v)]
    if not present:
        return None
    return {
        "median": statistics.median(present),
        "mean": statistics.fmean(present),
        "min": min(present),
        "max": max(present),
        "n": len(present),
    }


def share(numerator: float, denominator: float) -> float | None:
    """numerator / denominator, or None when there is nothing to divide by (no drafts, no steps)."""
    return numerator / denominator if denominator else None
