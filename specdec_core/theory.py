"""Closed forms of speculative decoding (Leviathan et al. 2023, section 3).

alpha: per-token acceptance rate; gamma: draft tokens per step; c: cost of one
draft step relative to one target pass.
"""

from __future__ import annotations


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens emitted per target pass: (1 - alpha^(gamma+1)) / (1 - alpha)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if alpha == 1:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def speedup(alpha: float, gamma: int, cost_ratio: float, verify_ratio: float = 1.0) -> float:
    """Speedup over plain decoding: tokens per pass over the time of gamma drafts and one verify pass.

    verify_ratio is the verify pass's cost relative to a plain one-token pass
    (1 when verifying gamma+1 tokens is as cheap as one, the memory-bound case).
    """
    return expected_tokens(alpha, gamma) / (gamma * cost_ratio + (verify_ratio if gamma else 1.0))


def optimal_gamma(alpha: float, cost_ratio: float, gamma_max: int = 32, verify_ratio: float = 1.0) -> tuple[int, float]:
    """The gamma in [0, gamma_max] with the highest speedup, and that speedup (gamma 0 is plain: 1.0)."""
    return max(
        ((g, speedup(alpha, g, cost_ratio, verify_ratio)) for g in range(gamma_max + 1)),
        key=lambda pair: pair[1],
    )
