"""Hybrid: a lookup where the text repeats itself, a model drafter elsewhere, per step and per row.

A row whose suffix matches earlier text for at least `min_n` tokens takes the
lookup's proposal (free, and right often when it exists): the n-gram
continuation, or the suffix drafter's tree (SuffixDecoding's pairing with a
model, drafting from earlier requests too); the others take the model
drafter's proposal. When either side proposes trees, the chains join them as
trees of one branch. The model drafts only in steps where some row
lacks a match, and then for the whole batch in one pass (a pass over B rows
costs about what one row costs in the memory-bound regime). A row that took
the n-gram proposal reports 0 kept tokens to the model drafter, which then
rolls that row back and catches it up next time it drafts; a drafter without
state (layer skip) has nothing to roll back. A feature drafter (EAGLE-3) hears of every
step, its features included: it must feed every committed token.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING

import torch

from ..models.runner import BatchCache
from ..prefix_cache import OwnPrefix
from ..sequence import Sequence
from .base import Drafter, DrafterBuilder, Proposal
from .ngram import NgramDrafter
from .suffix import SuffixDrafter

if TYPE_CHECKING:
    from ..config import Config
    from ..models.runner import ModelRunner


class HybridDrafter(Drafter):
    """Per row, the lookup's proposal (n-gram or suffix) when there is one, else the model drafter's."""

    def __init__(self, lookup: NgramDrafter | SuffixDrafter, model: Drafter):
        self.lookup = lookup
        self.model = model
        self._model_rows: list[bool] = []  # per row of the last proposal: it came from the model
        self._proposals: tuple[Proposal, Proposal | None] | None = None  # the last (lookup's, model's)
        self._rows = 0

    @property
    def remembers_requests(self) -> bool:
        return self.lookup.remembers_requests or self.model.remembers_requests

    def attach(self, cache: BatchCache) -> None:
        self.model.attach(cache)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.model.feature_layers

    @property
    def keeps_own_kv(self) -> bool:
        return self.model.keeps_own_kv

    def own_models(self) -> list[torch.nn.Module]:
        return self.model.own_models()

    def prefill(self, seq: Sequence, own: OwnPrefix | None, chunk_tokens: int) -> Generator[None, None, BatchCache | None]:
        return self.model.prefill(seq, own, chunk_tokens)

    def add(self, seq: Sequence, features: torch.Tensor | None = None, row: BatchCache | None = None) -> None:
        self.lookup.add(seq, features)
        try:
            self.model.add(seq, features, row)
        except BaseException:
            self.lookup.remove(list(range(self._rows)))  # the engine takes the row back: so must the lookup
            raise
        self._rows += 1

    def remove(self, keep: list[int]) -> None:
        self.lookup.remove(keep)
        self.model.remove(keep)
        self._rows = len(keep)

    def forget(self) -> None:
        self.lookup.forget()
        self.model.forget()

    def propose(self, seqs: list[Sequence], gamma: int) -> Proposal:
        found = self.lookup.propose(seqs, gamma)
        self._model_rows = [length == 0 for length in found.lengths]
        if not any(self._model_rows):
            self._proposals = found, None
            return found
        drafted = self.model.propose(seqs, gamma)
        self._proposals = found, drafted
        parts = [drafted if use else found for use in self._model_rows]
        lengths = [part.lengths[i] for i, part in enumerate(parts)]
        width = max(lengths)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        # Both deterministic (q one-hot) when the model's drafts are: the lookups' always are.
        probs = None if drafted.probs is None else torch.zeros(len(seqs), width, drafted.probs.shape[-1],
                                                                 device=drafted.probs.device)
        trees = found.parents is not None or drafted.parents is not None
        parents = []
        for i, (use, part, length) in enumerate(zip(self._model_rows, parts, lengths)):
            tokens[i, :length] = part.tokens[i, :length]
            if probs is not None and use:
                probs[i, :length] = drafted.probs[i, :length]
            elif probs is not None:  # a deterministic proposal is q one-hot, whatever the other rows' q
                probs[i, torch.arange(length), tokens[i, :length].to(probs.device)] = 1.0
            parents.append(part.parents[i] if part.parents is not None else list(range(-1, length - 1)))
        return Proposal(tokens=tokens, lengths=lengths, probs=probs, parents=parents if trees else None)

    def accepted(
        self, seqs: list[Sequence], proposal: Proposal, paths: list[list[int]], features: list[torch.Tensor] | None
    ) -> None:
        if self._proposals is None:  # a plain step (nothing proposed): only a feature drafter hears of it
            self.model.accepted(seqs, proposal, paths, features)
            return
        (found, drafted), self._proposals = self._proposals, None
        self.lookup.accepted(seqs, found, [[] if use else path for use, path in zip(self._model_rows, paths)], features)
        if drafted is not None or self.uses_features:
            kept = [path if use else [] for use, path in zip(self._model_rows, paths)]
            self.model.accepted(seqs, drafted or found, kept, features)


def from_config(config: Config, target: ModelRunner, build: DrafterBuilder) -> HybridDrafter:
    """Lookups (speculation.hybrid.lookup) of at least speculation.hybrid.min_n tokens, else the model drafter
    hybrid.drafter (built by name with `build`)."""
    spec = config.speculation
    hybrid, ngram, suffix = spec.hybrid, spec.ngram, spec.suffix
    lookup = (
        SuffixDrafter(suffix.max_tokens, suffix.shared, suffix.factor, suffix.min_probability, suffix.max_match,
                      suffix.max_nodes, min_match=hybrid.min_n) if hybrid.lookup == "suffix"
        else NgramDrafter(hybrid.min_n, max(hybrid.min_n, ngram.max_n), ngram.max_len, ngram.candidates, ngram.max_nodes)
    )
    return HybridDrafter(lookup, build(hybrid.drafter))
