"""One request's sequence as the engine decodes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .sampling import PositionNoise, SamplingParams

if TYPE_CHECKING:  # the grammar sits above sequences in the core's layers (pyproject.toml)
    from .grammar import GrammarState


@dataclass
class SpecStats:
    """Measured speculation figures of one sequence (usage.speculative)."""

    method: str = "none"
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    gamma_sum: int = 0
    emitted_tokens: int = 0  # by the steps that drafted, less the grammar's forced tokens
    grammar_draft_tokens: int = 0  # the grammar's forced continuations, drafted (drafters/grammar.py)
    grammar_accepted_tokens: int = 0

    def as_usage(self) -> dict:
        return {
            "method": self.method,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "verify_steps": self.verify_steps,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            "mean_accepted_length": self.emitted_tokens / self.verify_steps if self.verify_steps else 0.0,
            "mean_gamma": self.gamma_sum / self.verify_steps if self.verify_steps else 0.0,
            "grammar_draft_tokens": self.grammar_draft_tokens,
            "grammar_accepted_tokens": self.grammar_accepted_tokens,
        }


@dataclass
class Sequence:
    """Prompt, output so far, and per-request settings of one generated sequence."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    client: str | None = None  # who asked (API key hash, else address): the suffix drafter's memory is per client
    cache_namespace: str = ""  # whose prefix cache it reads and fills: its API key's and its cache_salt's
    top_logprobs: int | None = None  # None: no logprobs; k: the target's logprob plus its top k
    output_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprob_ids: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    noise: PositionNoise | None = None  # sampled rows under the Gumbel rule: draws keyed by position
    counts: torch.Tensor | None = None  # [V] output token counts, only when penalties need them
    stats: SpecStats = field(default_factory=SpecStats)
    cached_tokens: int = 0  # prompt tokens the prefix cache gave (usage.prompt_tokens_details.cached_tokens)
    grammar: GrammarState | None = None  # what the output must follow (response_format, tools): grammar.py
    speculate: bool = True  # False: this sequence is never drafted for (gamma 0), whatever the batch does

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.output_ids)

    @property
    def draft_budget(self) -> int:
        """Most tokens a step may draft for it: the step emits at most `remaining`, one of them the target's."""
        return max(self.remaining - 1, 0) if self.speculate else 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
