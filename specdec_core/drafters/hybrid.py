"""Hybrid: an n-gram proposal where the text repeats itself, a model drafter elsewhere, per step and per row.

A row whose suffix matches earlier text for at least `min_n` tokens takes the
n-gram continuation (free, and right often when it exists); the others take
the model drafter's proposal. The model drafts only in steps where some row
lacks a match, and then for the whole batch in one pass (a pass over B rows
costs about what one row costs in the memory-bound regime). A row that took
the n-gram proposal reports 0 kept tokens to the model drafter, which then
rolls that row back and catches it up next time it drafts; a drafter without
state (layer skip) has nothing to roll back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..models.runner import BatchCache
from ..sequence import Sequence
from .base import Drafter, DrafterBuilder, Proposal
from .ngram import NgramDrafter

if TYPE_CHECKING:
    from ..config import Config
    from ..models.runner import ModelRunner


class HybridDrafter(Drafter):
    """Per row, the n-gram proposal when there is one, else the model drafter's."""

    def __init__(self, ngram: NgramDrafter, model: Drafter):
        self.ngram = ngram
        self.model = model
        self._model_rows: list[bool] = []  # per row of the last proposal: it came from the model
        self._model_proposal: Proposal | None = None

    def attach(self, cache: BatchCache) -> None:
        self.model.attach(cache)

    def add(self, seq: Sequence, features: torch.Tensor | None = None) -> None:
        self.model.add(seq, features)

    def remove(self, keep: list[int]) -> None:
        self.model.remove(keep)

    def propose(self, seqs: list[Sequence], gamma: int) -> Proposal:
        found = self.ngram.propose(seqs, gamma)
        self._model_rows = [length == 0 for length in found.lengths]
        if not any(self._model_rows):
            self._model_proposal = None
            return found
        drafted = self._model_proposal = self.model.propose(seqs, gamma)
        lengths = [m if use else n for use, m, n in zip(self._model_rows, drafted.lengths, found.lengths)]
        width = max(lengths)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        probs = torch.zeros(len(seqs), width, drafted.probs.shape[-1], device=drafted.probs.device)
        for i, (use, length) in enumerate(zip(self._model_rows, lengths)):
            if use:
                tokens[i, :length] = drafted.tokens[i, :length]
                probs[i, :length] = drafted.probs[i, :length]
            else:
                tokens[i, :length] = found.tokens[i, :length]
                # A deterministic proposal is q one-hot, whatever the other rows' q.
                probs[i, torch.arange(length), tokens[i, :length].to(probs.device)] = 1.0
        return Proposal(tokens=tokens, lengths=lengths, probs=probs)

    def accepted(
        self, seqs: list[Sequence], proposal: Proposal, paths: list[list[int]], features: list[torch.Tensor] | None
    ) -> None:
        if self._model_proposal is not None:
            kept = [path if use else [] for use, path in zip(self._model_rows, paths)]
            self.model.accepted(seqs, self._model_proposal, kept, features)


def from_config(config: Config, target: ModelRunner, build: DrafterBuilder) -> HybridDrafter:
    """n-gram lookups of at least speculation.hybrid.min_n tokens, else the model drafter hybrid.drafter (built by
    name with `build`)."""
    spec = config.speculation
    ngram = NgramDrafter(spec.hybrid.min_n, max(spec.hybrid.min_n, spec.ngram.max_n), spec.ngram.max_len)
    return HybridDrafter(ngram, build(spec.hybrid.drafter))
