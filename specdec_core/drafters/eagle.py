"""EAGLE-2 drafting: a dynamic token tree grown by the EAGLE network over its own predicted features.

State per row: the draft network's cache holds the pairs (feature_t, token_{t+1}) of every token
but the row's last, built from the target's real features; `roots` holds the network's predicted
feature of the last token (from the last pair), whose logits draft the first tree level.

A proposal (Li et al. 2024, EAGLE-2) grows the tree level by level: every expanded node proposes
its top_k tokens, each scored by its cumulative draft log-probability (the product of the draft
probabilities along its path, a proxy for the chance the target accepts it); the top_k children
of a level by that score are fed to the network as pending slots of its cache (tree attention)
and expanded next. Finally all grown nodes are reranked by score and the best `total_tokens`
form the proposal; a child never outscores its parent, so the kept nodes form a tree. Tokens
are deterministic (q one-hot), which keeps tree sampling exact. The pending slots are dropped
after the proposal: once the target has judged it, `accepted` feeds the committed tokens with
the target's real features, as EAGLE does, so the cache never holds a rejected node.

EAGLE-3's network (models/eagle3_net.py) drafts the same way from the target's features at three depths; its
config (drafters/eagle3.py) makes the tree a chain by default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..models.artifacts import EAGLE
from ..models.eagle_net import CachedDraftLayer, load_eagle
from ..models.runner import BatchCache
from ..sequence import Sequence
from .base import Drafter, DrafterBuilder, Proposal

if TYPE_CHECKING:
    from ..config import Config
    from ..models.runner import ModelRunner


class EagleDrafter(Drafter):
    """A dynamic draft tree per row from an EAGLE network (EAGLE's or EAGLE-3's) over the target's features."""

    def __init__(self, net: CachedDraftLayer, top_k: int, depth: int, total_tokens: int):
        self.net = net
        self.top_k = top_k
        self.depth = depth
        self.total_tokens = total_tokens
        self.feature_layers = net.feature_layers
        self.cache = BatchCache.empty(net.device)
        self.roots = torch.zeros(0, net.hidden_size, dtype=net.dtype, device=net.device)

    def add(self, seq: Sequence, features: torch.Tensor | None = None, row: BatchCache | None = None) -> None:
        device = self.cache.device
        row = BatchCache.empty(device)
        # The prefill holds the whole prompt (its last token's logits drew the row's first): n >= 1 features.
        n = len(features)
        tokens = torch.tensor([seq.tokens[1 : n + 1]], device=device)
        keep = torch.ones(1, n, dtype=torch.bool, device=device)
        root = self.net.feed(row, features[None], tokens, keep)[0, -1]
        self.cache.append(row)
        self.roots = torch.cat([self.roots, root[None]])

    def remove(self, keep: list[int]) -> None:
        self.cache.keep_rows(keep)
        self.roots = self.roots[torch.tensor(keep, dtype=torch.long, device=self.roots.device)]

    @torch.no_grad()
    def propose(self, seqs: list[Sequence], gamma: int) -> Proposal:
        tree = self._grow(min(gamma, self.depth))
        self.cache.drop_pending()
        tokens, parents = tree.best(self.total_tokens)
        return Proposal(tokens=tokens.cpu(), lengths=[tokens.shape[1]] * len(seqs), probs=None, parents=parents)

    def _grow(self, depth: int) -> Tree:
        """All nodes of `depth` levels, expanding the top_k of each level by cumulative log-probability."""
        net, k = self.net, self.top_k
        batch = self.roots.shape[0]
        device = self.roots.device
        tree = Tree(batch, device)
        features = self.roots[:, None]  # [B, F, H]: the expanded nodes' predicted features (F = 1: the roots)
        scores = torch.zeros(batch, 1, device=device)
        nodes = torch.full((batch, 1), -1, dtype=torch.long, device=device)  # their indices in `tree`
        ancestors = torch.zeros(batch, 0, 0, dtype=torch.bool, device=device)  # over pending slots, self included
        for level in range(1, depth + 1):
            top = net.logits(features).log_softmax(-1).topk(k, dim=-1)  # [B, F, k]
            first = tree.size
            child_scores = (scores[..., None] + top.values).flatten(1)
            tree.extend(net.full_ids(top.indices.flatten(1)), nodes[..., None].expand(-1, -1, k).flatten(1), child_scores)
            if level == depth:
                break
            scores, pick = child_scores.topk(k, dim=-1)  # the level's best children, expanded next
            parent = pick // k  # which expanded node each is a child of: a pending slot of the last level
            previous = ancestors[:, ancestors.shape[1] - features.shape[1] :] if level > 1 else ancestors.new_zeros(batch, 1, 0)
            rows = _take(previous, parent)  # the children see their parent's slot and its ancestors
            nodes = first + pick
            features = net.feed_pending(self.cache, _take(features, parent), tree.tokens.gather(1, nodes), level, rows)
            ancestors = _grow_ancestors(ancestors, rows)
        return tree

    @torch.no_grad()
    def accepted(
        self, seqs: list[Sequence], proposal: Proposal, paths: list[list[int]], features: list[torch.Tensor] | None
    ) -> None:
        # Pairs (feature_t, token_{t+1}) of the tokens this step committed, t from each row's count of pairs on.
        fed = self.cache.lengths.tolist()
        counts = [min(len(f), len(seq.tokens) - 1 - start) for f, seq, start in zip(features, seqs, fed)]
        width = max(counts, default=0)
        if not width:
            return
        device = self.cache.device
        batch = len(seqs)
        inputs = self.roots.new_zeros(batch, width, features[0].shape[-1])
        tokens = torch.zeros(batch, width, dtype=torch.long)
        keep = torch.zeros(batch, width, dtype=torch.bool)
        for i, (seq, start, count) in enumerate(zip(seqs, fed, counts)):
            inputs[i, :count] = features[i][:count]
            tokens[i, :count] = torch.tensor(seq.tokens[start + 1 : start + 1 + count])
            keep[i, :count] = True
        predicted = self.net.feed(self.cache, inputs, tokens.to(device), keep.to(device))
        last = torch.tensor([max(count - 1, 0) for count in counts], device=device)
        has = torch.tensor([count > 0 for count in counts], device=device)
        self.roots = torch.where(has[:, None], predicted[torch.arange(batch, device=device), last], self.roots)


def _take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values [B, F, D] at index [B, k] along F: [B, k, D]."""
    return values.gather(1, index[..., None].expand(-1, -1, values.shape[2]))


def _grow_ancestors(ancestors: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The ancestor matrix [B, P, P] over pending slots with k new slots whose ancestor rows are `rows` [B, k, P]."""
    batch, k, pending = rows.shape
    top = torch.cat([ancestors, ancestors.new_zeros(batch, pending, k)], dim=2)
    bottom = torch.cat([rows, torch.eye(k, dtype=torch.bool, device=rows.device).expand(batch, k, k)], dim=2)
    return torch.cat([top, bottom], dim=1)


class Tree:
    """Grown nodes of a batch, in growth order (a parent before its children): tokens, parents, scores [B, N]."""

    def __init__(self, batch: int, device: torch.device):
        self.tokens = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.parents = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.scores = torch.zeros(batch, 0, device=device)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def extend(self, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor) -> None:
        self.tokens = torch.cat([self.tokens, tokens], dim=1)
        self.parents = torch.cat([self.parents, parents], dim=1)
        self.scores = torch.cat([self.scores, scores], dim=1)

    def best(self, budget: int) -> tuple[torch.Tensor, list[list[int]]]:
        """The `budget` best-scored nodes of each row in growth order, and their parents renumbered.

        The sort is stable, so on a tie the parent (grown first) still ranks before its child."""
        order = torch.sort(self.scores, dim=1, descending=True, stable=True).indices[:, :budget]
        chosen = order.sort(dim=1).values
        renumber = torch.full_like(self.parents, -1)
        renumber.scatter_(1, chosen, torch.arange(chosen.shape[1], device=chosen.device).expand_as(chosen))
        old_parents = self.parents.gather(1, chosen)
        parents = torch.where(old_parents < 0, old_parents, renumber.gather(1, old_parents.clamp_min(0)))
        return self.tokens.gather(1, chosen), parents.tolist()


def from_config(config: Config, target: ModelRunner, build: DrafterBuilder) -> EagleDrafter:
    """speculation.eagle's trained network over `target`; weights not trained yet raise MissingArtifactError,
    which names the command that trains them."""
    settings = config.speculation.eagle
    net = load_eagle(settings.weights or EAGLE.default_name(config.model.target), target.model, config.model.target)
    return EagleDrafter(net, settings.top_k, settings.depth, settings.total_tokens)
