"""N-gram / prompt-lookup drafter (Saxena 2023; llama.cpp's lookup).

Finds the most recent earlier occurrence of the last n tokens of prompt plus
output (the longest n first, from max_n down to min_n) and proposes what
followed it. The proposal is deterministic, so q is one-hot and the
acceptance rule stays exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..sequence import Sequence
from .base import Drafter, DrafterBuilder, Proposal

if TYPE_CHECKING:
    from ..config import Config
    from ..models.runner import ModelRunner


def lookup(tokens: list[int], min_n: int, max_n: int, max_len: int) -> list[int]:
    """Continuation of the latest earlier match of the longest suffix n-gram (n in [min_n, max_n])."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Scan right to left so the most recent occurrence wins; the suffix itself is excluded.
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + max_len]
    return []


class NgramDrafter(Drafter):
    """The continuation of the latest earlier match of each row's suffix."""

    def __init__(self, min_n: int = 1, max_n: int = 3, max_len: int = 8):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.max_len = min_n, max_n, max_len

    def propose(self, seqs: list[Sequence], gamma: int) -> Proposal:
        drafts = [lookup(seq.tokens, self.min_n, self.max_n, min(gamma, self.max_len)) for seq in seqs]
        width = max((len(d) for d in drafts), default=0)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, draft in enumerate(drafts):
            tokens[i, : len(draft)] = torch.tensor(draft, dtype=torch.long)
        return Proposal(tokens=tokens, lengths=[len(d) for d in drafts], probs=None)


def from_config(config: Config, target: ModelRunner, build: DrafterBuilder) -> NgramDrafter:
    """The n-gram drafter of speculation.ngram."""
    ngram = config.speculation.ngram
    return NgramDrafter(ngram.min_n, ngram.max_n, ngram.max_len)
