"""The interface every drafter implements.

A drafter keeps one row of state per sequence, in the engine's row order. Each
step it proposes up to gamma tokens per row (a chain, or a tree: see tree.py)
with the distribution q it drew them from, then learns which the target kept
so it can roll back. Drafters that read the target's features (its final-normed
last hidden states: Medusa, EAGLE; three depths' for EAGLE-3) get them for every token the target commits.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from ..models.runner import BatchCache
from ..prefix_cache import OwnPrefix
from ..sequence import Sequence


@dataclass
class Proposal:
    """Draft tokens of a batch. Row i proposes tokens[i, :lengths[i]]: a chain, or a tree when `parents` is set."""

    tokens: torch.Tensor  # [B, G] long, padded
    lengths: list[int]
    probs: torch.Tensor | None  # [B, G, V] the q each token was drawn from; None when deterministic (q one-hot)
    parents: list[list[int]] | None = None  # per row, each node's parent (-1: the row's last token); None: chains
    # When a grammar's forced tokens lead (drafters/grammar.py): per row, how many leading nodes the grammar drafted,
    # each node's index in `own` (-1: the grammar's), and the drafter's own proposal.
    forced: list[int] | None = None
    origin: list[list[int]] | None = None
    own: Proposal | None = None

    @property
    def width(self) -> int:
        return max(self.lengths, default=0)

    def keep(self, kept: list[list[int]]) -> Proposal:
        """Row i's nodes kept[i] alone (each with its ancestors, in order), renumbered."""
        width = max(map(len, kept), default=0)
        tokens = self.tokens.new_zeros(len(kept), width)
        probs = None if self.probs is None else self.probs.new_zeros(len(kept), width, self.probs.shape[-1])
        parents = None if self.parents is None else []
        for i, nodes in enumerate(kept):
            tokens[i, : len(nodes)] = self.tokens[i, nodes]
            if probs is not None:
                probs[i, : len(nodes)] = self.probs[i, nodes]
            if parents is not None:
                index = {j: k for k, j in enumerate(nodes)}
                parents.append([index[self.parents[i][j]] if self.parents[i][j] >= 0 else -1 for j in nodes])
        return Proposal(
            tokens, [len(nodes) for nodes in kept], probs, parents,
            forced=None if self.forced is None else [sum(j < f for j in nodes) for f, nodes in zip(self.forced, kept)],
            origin=None if self.origin is None else [[self.origin[i][j] for j in nodes] for i, nodes in enumerate(kept)],
            own=self.own,
        )


class Drafter(ABC):
    """Proposes draft tokens for a batch of sequences."""

    name = "unnamed"  # what stats and metrics call it: build.registered_drafter names a drafter by its registry key
    # The target's hidden states it reads (indices into a pass's: each layer's input, then the final-normed output),
    # concatenated: the engine runs the target with them and passes them to add() and accepted().
    feature_layers: tuple[int, ...] = ()
    remembers_requests = False  # what it drafts depends on earlier requests (a cross-request memory)
    # It drafts from the text alone (no state of the committed tokens), so `propose` takes `pending`: per row,
    # tokens drafted before its own (a grammar's forced continuation) to draft after.
    drafts_from_text = False
    keeps_own_kv = False  # it has a cache of its own whose keys and values the prefix cache keeps (prefill's `own`)

    @property
    def uses_features(self) -> bool:
        return bool(self.feature_layers)

    def attach(self, cache: BatchCache) -> None:
        """The engine's target cache, once: a drafter that drafts from the target's own cache keeps it."""

    def own_models(self) -> list[torch.nn.Module]:
        """The models it runs passes of its own on (a draft model): their prefill passes keep their bf16 weights
        as the target's do (`prefill.keep_bf16_weights`)."""
        return []

    def prefill(self, seq: Sequence, own: OwnPrefix | None, chunk_tokens: int) -> Generator[None, None, BatchCache | None]:
        """Its own prefill of a sequence about to join (drafters with a cache of their own), a pass of at most
        `chunk_tokens` tokens per next(), so that the engine steps the running rows between them; returns the
        prefilled row for `add`. `own` (where the prefix cache is on): its own keys and values of the prompt's
        first whole blocks, to take instead of prefilling them, and where it leaves those of the later ones."""
        yield from ()
        return None

    def add(self, seq: Sequence, features: torch.Tensor | None = None, row: BatchCache | None = None) -> None:
        """A new sequence joins as the last row; `features` [len(seq.tokens) - 1, F] are its prefilled tokens',
        `row` what its `prefill` returned."""

    def remove(self, keep: list[int]) -> None:
        """Only the rows at indices `keep` stay, in that order."""

    def forget(self) -> None:
        """Whatever it remembers of earlier requests is dropped, as in a server just started."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], gamma: int) -> Proposal:
        """Up to gamma draft tokens for each row."""

    def accepted(
        self, seqs: list[Sequence], proposal: Proposal, paths: list[list[int]], features: list[torch.Tensor] | None
    ) -> None:
        """The target kept nodes paths[i] of row i's proposal, root to leaf (a chain's first len(paths[i]));
        seqs are already extended. features[i] [len(paths[i]) + 1, F] are those of the tokens this step
        committed to the cache: the row's previous last token, then each kept node (None unless uses_features)."""


# What a drafter's from_config (drafters/registry.py) gets to make another drafter by its registry name, for the
# same config and target: the hybrid's model drafter.
DrafterBuilder = Callable[[str], Drafter]
