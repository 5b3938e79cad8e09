"""N-gram / prompt-lookup drafter (Saxena 2023; llama.cpp's lookup).

Finds the most recent earlier occurrence of the last n tokens of prompt plus
output (the longest n first, from max_n down to min_n) and proposes what
followed it. With `candidates` above 1 it takes that many of the most recent
occurrences and proposes what followed each, deduplicated into a tree (the
most common continuations first, up to `max_nodes` nodes). Proposals are
deterministic, so q is one-hot and the acceptance rule stays exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..sequence import Sequence
from ..tree import continuation_tree
from .base import Drafter, DrafterBuilder, Proposal

if TYPE_CHECKING:
    from ..config import Config
    from ..models.runner import ModelRunner


def lookup(tokens: list[int], min_n: int, max_n: int, max_len: int, candidates: int = 1) -> list[list[int]]:
    """Continuations of the latest `candidates` earlier matches of the longest suffix n-gram that has one
    (n in [min_n, max_n]), most recent first."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        found = []
        # Scan right to left so the most recent occurrences come first; the suffix itself is excluded.
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                found.append(tokens[start + n : start + n + max_len])
                if len(found) == candidates:
                    break
        if found:
            return found
    return []


class NgramDrafter(Drafter):
    """The continuation of the latest earlier match of each row's suffix, or a tree of the latest matches'."""

    def __init__(self, min_n: int = 1, max_n: int = 3, max_len: int = 8, candidates: int = 1, max_nodes: int = 16):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.max_len = min_n, max_n, max_len
        self.candidates, self.max_nodes = candidates, max_nodes

    drafts_from_text = True

    def propose(self, seqs: list[Sequence], gamma: int, pending: list[list[int]] | None = None) -> Proposal:
        texts = [seq.tokens + after for seq, after in zip(seqs, pending)] if pending else [seq.tokens for seq in seqs]
        found = [lookup(text, self.min_n, self.max_n, min(gamma, self.max_len), self.candidates) for text in texts]
        if self.candidates == 1:
            drafts, parents = [continuations[0] if continuations else [] for continuations in found], None
        else:
            trees = [continuation_tree([c for c in continuations if c], self.max_nodes, 0.0) for continuations in found]
            drafts, parents = [tokens for tokens, _ in trees], [row for _, row in trees]
        width = max((len(d) for d in drafts), default=0)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, draft in enumerate(drafts):
            tokens[i, : len(draft)] = torch.tensor(draft, dtype=torch.long)
        return Proposal(tokens=tokens, lengths=[len(d) for d in drafts], probs=None, parents=parents)


def from_config(config: Config, target: ModelRunner, build: DrafterBuilder) -> NgramDrafter:
    """The n-gram drafter of speculation.ngram."""
    ngram = config.speculation.ngram
    return NgramDrafter(ngram.min_n, ngram.max_n, ngram.max_len, ngram.candidates, ngram.max_nodes)
