"""Medusa (Cai et al. 2024): K heads on the target's features propose a token tree each step.

Head i, read at the feature of token t, predicts the token at t+i+2 (models/medusa_heads.py).
The engine keeps a row's last token out of the cache, so the latest feature a row has is that of
the token before its last one: head 0 there predicts the root's children, head d-1 depth d.

Each step builds one candidate tree per row from the heads' top-k: a node's score is the product
of the head probabilities along its path (an estimate of the chance the target keeps it), and
the best `tree_nodes` nodes are kept. Scores only fall going down, so taking nodes best-first
yields a tree (every kept node's parent is kept before it). Siblings come out in score order, so
verification tries the likeliest first. Tokens are deterministic (q one-hot: probs None), and
siblings are distinct, so SpecInfer's rule keeps sampling exact.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import torch

from ..models.artifacts import HEADS
from ..models.loading import reducible
from ..models.medusa_heads import (
    MedusaHeads,
    full_ids,
    head_logits,
    load_heads,
    output_layer,
)
from ..models.runner import BatchCache, ModelRunner
from ..models.vocab import ReducedVocab
from ..sequence import Sequence
from .base import Drafter, DrafterBuilder, Proposal

if TYPE_CHECKING:
    from ..config import Config


def candidate_tree(probs: list[list[float]], budget: int) -> tuple[list[tuple[int, int]], list[int]]:
    """The `budget` likeliest nodes of the tree whose depth-d children are the ranks of probs[d-1].

    probs [D][k], each row descending: the top-k probabilities of the head for depth d. Returns
    each node's (depth - 1, rank) and its parent (-1: the root), best-first, so parents precede
    children and siblings come in score order.
    """
    nodes: list[tuple[int, int]] = []
    parents: list[int] = []
    # Lazy best-first: a taken node offers its next sibling and its best child, the only
    # candidates that can be next-best among its later siblings and its descendants.
    # Entries: (-score, order pushed, parent, the parent's score, depth - 1, rank).
    frontier = [(-probs[0][0], 0, -1, 1.0, 0, 0)] if probs and probs[0] else []
    pushed = 1
    while frontier and len(nodes) < budget:
        negative_score, _, parent, parent_score, level, rank = heapq.heappop(frontier)
        nodes.append((level, rank))
        parents.append(parent)
        offers = []
        if rank + 1 < len(probs[level]):
            offers.append((parent_score * probs[level][rank + 1], parent, parent_score, level, rank + 1))
        if level + 1 < len(probs):
            offers.append((-negative_score * probs[level + 1][0], len(nodes) - 1, -negative_score, level + 1, 0))
        for score, *where in offers:
            heapq.heappush(frontier, (-score, pushed, *where))
            pushed += 1
    return nodes, parents


class MedusaDrafter(Drafter):
    """Per-step candidate trees from Medusa heads over the target's own features."""

    feature_layers = (-1,)  # the target's final-normed last hidden state

    def __init__(self, target: ModelRunner, heads: MedusaHeads, vocab: ReducedVocab | None, tree_nodes: int, top_k: int):
        """`vocab`: the reduced vocabulary the heads were trained over (their output layer is those rows
        of the target's), or None for the full one."""
        self.heads = heads.to(target.device)
        self.vocab = vocab
        self.output = output_layer(target.model.get_output_embeddings(), vocab)
        self.tree_nodes = tree_nodes
        self.top_k = top_k
        hidden = target.config.hidden_size
        self.features = torch.zeros(0, hidden, dtype=target.dtype, device=target.device)  # [B, H] latest committed

    def add(self, seq: Sequence, features: torch.Tensor | None = None, row: BatchCache | None = None) -> None:
        # The prefill holds the whole prompt (its last token's logits drew the row's first): a feature is there.
        self.features = torch.cat([self.features, features[-1:].to(self.features.dtype)])

    def remove(self, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.features.device)
        self.features = self.features.index_select(0, index)

    @torch.no_grad()
    def propose(self, seqs: list[Sequence], gamma: int) -> Proposal:
        depth = min(gamma, self.heads.num_heads)
        probs = head_logits(self.heads, self.features, self.output)[:, :depth].float().softmax(-1)
        top = probs.topk(min(self.top_k, probs.shape[-1]), dim=-1)
        ids = full_ids(top.indices, self.vocab).cpu()
        top_probs = top.values.tolist()
        rows = [candidate_tree(top_probs[i], self.tree_nodes) for i in range(len(seqs))]
        width = max((len(nodes) for nodes, _ in rows), default=0)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, (nodes, _) in enumerate(rows):
            for j, (level, rank) in enumerate(nodes):
                tokens[i, j] = ids[i, level, rank]
        return Proposal(tokens=tokens, lengths=[len(nodes) for nodes, _ in rows], probs=None,
                        parents=[parents for _, parents in rows])

    def accepted(
        self, seqs: list[Sequence], proposal: Proposal, paths: list[list[int]], features: list[torch.Tensor] | None
    ) -> None:
        # The last committed token is the one before each row's new last token: the heads read its feature.
        self.features = torch.stack([row[-1] for row in features]).to(self.features.dtype)


def from_config(config: Config, target: ModelRunner, build: DrafterBuilder) -> MedusaDrafter:
    """speculation.medusa's trained heads over `target`; heads not trained yet raise MissingArtifactError,
    which names the command that trains them."""
    settings = config.speculation.medusa
    heads, _, vocab = load_heads(settings.heads or HEADS.default_name(config.model.target), config.model.target)
    return MedusaDrafter(target, heads, reducible(vocab, target.model), settings.tree_nodes, settings.top_k)
