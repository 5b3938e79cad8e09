"""Logits to probabilities, and draws from them.

The same transforms shape the target's p and the drafter's q, so that the
acceptance rule compares like with like. Penalties follow OpenAI's definition:
logit -= frequency_penalty * count + presence_penalty * (count > 0), counted
over the tokens generated so far (the prompt does not count).

Draws keyed by position (`PositionNoise`) make the token at output position t
argmax(log p_t + g_t), the Gumbel-max trick: an exact draw from p_t, with g_t
a function of the seed and t alone, from a counter-based generator (numpy's
Philox, keyed by the seed, its counter at t). No sequential stream is
consumed, so how many tokens a step drafts, keeps or verifies cannot change
any draw: a seed gives plain decoding's text with any drafter, gamma or tree,
wherever the target's passes are row-invariant (ModelRunner.row_invariant);
elsewhere rounding can still part them at near-ties.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

# Temperatures below this are greedy, as in vLLM: logits / 1e-40 overflow to inf, and the softmax
# of such a row is NaN. At 1e-5 a logit gap of 0.01 is already a factor of e^1000.
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling settings; a temperature of 0 (or below GREEDY_BELOW) is greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def uses_counts(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """One generator per request: a seed reproduces its completion."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def running_counts(base: torch.Tensor | None, tokens: torch.Tensor, vocab: int) -> torch.Tensor | None:
    """Token counts before each of len(tokens)+1 positions: base, then base plus each token in turn."""
    if base is None:
        return None
    steps = torch.zeros(len(tokens) + 1, vocab, dtype=base.dtype, device=base.device)
    if len(tokens):
        steps[torch.arange(1, len(tokens) + 1), tokens.to(base.device)] = 1
    return base + steps.cumsum(dim=0)


def adjust_logits(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Logit bias and penalties on logits [k, V]; counts [k, V] are the counts before each row."""
    if params.logit_bias:
        logits = logits.clone()
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        logits[:, ids] += torch.tensor(list(params.logit_bias.values()), device=logits.device, dtype=logits.dtype)
    if params.uses_counts and counts is not None:
        counts = counts.to(logits.dtype)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def sampling_logits(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None = None) -> torch.Tensor:
    """The sampling distribution's logits [k, V] from raw logits [k, V] (temperature > 0): -inf outside top-k and
    top-p; their softmax is `to_probs`."""
    logits = adjust_logits(logits, params, counts) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays (even at top_p 0).
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def to_probs(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Sampling distribution [k, V] from raw logits [k, V] (temperature > 0)."""
    return sampling_logits(logits, params, counts).softmax(dim=-1)


def greedy_tokens(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Argmax tokens [k] of logits [k, V] after bias and penalties."""
    return adjust_logits(logits, params, counts).argmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of probs [k, V]."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class PositionNoise:
    """Gumbel noise g_t [V] for one sequence, a function of (seed, t) alone; rows are made on first use and
    kept until the sequence has passed them."""

    def __init__(self, seed: int, vocab: int, device: torch.device):
        self.seed, self.vocab, self.device = seed, vocab, device
        self._rows: dict[int, torch.Tensor] = {}

    def at(self, positions: Iterable[int]) -> torch.Tensor:
        """[len(positions), V] float32: g at each output position."""
        rows = []
        for t in positions:
            if t not in self._rows:
                # The position in the counter's second word: the first counts the draws within a position.
                generator = np.random.Generator(np.random.Philox(key=self.seed % 2**64, counter=t << 64))
                # An exponential of exactly 0 (about 2^-53 a draw) would be noise +inf, and +inf - inf is NaN.
                exponentials = np.maximum(generator.standard_exponential(self.vocab), np.finfo(np.float64).tiny)
                self._rows[t] = torch.from_numpy(-np.log(exponentials)).float().to(self.device)
            rows.append(self._rows[t])
        return torch.stack(rows)

    def forget_before(self, position: int) -> None:
        for t in [t for t in self._rows if t < position]:
            del self._rows[t]


def keyed_tokens(scores: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Gumbel-max draws [k]: argmax of sampling logits (or log-probabilities) [k, V] plus noise [k, V]."""
    return (scores + noise).argmax(dim=-1)
