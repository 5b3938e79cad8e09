"""The interface every drafter implements.

A drafter keeps one row of state per sequence, in the engine's row order. Each
step it proposes up to gamma tokens per row with the distribution q it drew
them from, then learns how many the target kept so it can roll back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..models.runner import BatchCache
from ..sequence import Sequence


@dataclass
class Proposal:
    """Draft tokens of a batch. Row i proposes tokens[i, :lengths[i]]."""

    tokens: torch.Tensor  # [B, G] long, padded
    lengths: list[int]
    probs: torch.Tensor | None  # [B, G, V] q; None when each proposal is deterministic (q one-hot)

    @property
    def width(self) -> int:
        return max(self.lengths, default=0)


class Drafter(ABC):
    """Proposes draft tokens for a batch of sequences."""

    name: str

    def attach(self, cache: BatchCache) -> None:
        """The engine's target cache, once: a drafter that drafts from the target's own cache keeps it."""

    def add(self, seq: Sequence) -> None:
        """A new sequence joins as the last row."""

    def remove(self, keep: list[int]) -> None:
        """Only the rows at indices `keep` stay, in that order."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], gamma: int) -> Proposal:
        """Up to gamma draft tokens for each row."""

    def accepted(self, seqs: list[Sequence], proposal: Proposal, accepted: list[int]) -> None:
        """The target kept the first accepted[i] tokens of row i's proposal (seqs already extended)."""
