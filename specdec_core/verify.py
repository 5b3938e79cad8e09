"""Exact acceptance rules: what a target keeps of a drafter's proposal.

Sampled (Leviathan et al. 2023; Chen et al. 2023): draft token x, drawn from q,
is kept with probability min(1, p(x) / q(x)); at the first rejection the
replacement is drawn from norm(max(0, p - q)); when all are kept a bonus token
is drawn from p. The emitted tokens are then distributed exactly as sampling
from p token by token. Greedy: keep the longest prefix equal to the target's
argmax, then the target's own next token. The Gumbel rule (sampling.py) needs
no rule of its own: its targets are the target's draws keyed by position, and
they are judged as greedy rows are.

Trees (SpecInfer, Miao et al. 2024): walk down from the root; at each node try
its children in order, keeping child x with probability min(1, p(x) / q(x))
and on a rejection replacing p by norm(max(0, p - q)) before the next sibling.
Siblings are either drawn independently from one q, or distinct deterministic
tokens (q one-hot, so a rejection just removes x from p). When no child is
kept the token is drawn from what is left of p. Greedy trees follow the
target's argmax down the tree.

Every rule here judges a whole batch at once, in tensor operations over all
rows and positions (as vLLM's rejection sampler does), so nothing is read back
to the host until the caller reads the result. Chains come padded: row i's
drafts are drafts[i, :lengths[i]], and position j of the target's p [B, G+1, V]
(or argmax tokens [B, G+1]) is the target after j draft tokens. Trees come as
their nodes in topological order (tree.py), padded to N: position 0 of p is
the target after the root, position j+1 after node j; the walk runs depth by
depth, as many steps as the deepest tree, each trying as many siblings as the
widest node at that depth has, counts known on the host from the trees' shape.
Sampled rules take one generator per row and draw from it twice a step: one
uniform per draft token (or node) in one call, then the emitted token after
the kept ones, so a seed fixes a row's outcome whatever the batch around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample
from .tree import children, depths


@dataclass
class Accepted:
    """What each row of a batch keeps of its drafts, on the device."""

    counts: torch.Tensor  # [B] draft tokens kept (a tree's: the kept path's depth)
    tokens: torch.Tensor  # [B, D+1] emitted: row i's first counts[i] + 1 (the kept drafts, then the target's token)
    path: torch.Tensor | None = None  # [B, D] trees: kept nodes root to leaf, -1 past counts[i]; chains keep their first counts[i]


def accept_chains_greedy(drafts: torch.Tensor, lengths: list[int], target_tokens: torch.Tensor) -> Accepted:
    """drafts [B, G] (row i's first lengths[i]), target_tokens [B, G+1] (argmax after each prefix)."""
    width = drafts.shape[1]
    matches = (drafts == target_tokens[:, :width]) & _within(lengths, width, drafts.device)
    # The kept drafts equal the target's tokens, so the target's row is already what is emitted.
    return Accepted(matches.long().cumprod(-1).sum(-1), target_tokens)


def accept_chains_sampled(
    drafts: torch.Tensor, lengths: list[int], p: torch.Tensor, q: torch.Tensor | None, generators: list[torch.Generator]
) -> Accepted:
    """drafts [B, G] (row i's first lengths[i]) drawn from q [B, G, V] (None: each draft token had q = 1),
    p [B, G+1, V]; generators[i] draws row i's uniforms (one per draft token), then its emitted token."""
    batch, width = drafts.shape
    rows = torch.arange(batch, device=p.device)
    uniforms = _uniforms(generators, lengths, width, p.device)
    p_draft = p[:, :width].gather(-1, drafts[..., None]).squeeze(-1)
    q_draft = q.gather(-1, drafts[..., None]).squeeze(-1) if q is not None else torch.ones_like(p_draft)
    kept = ~(uniforms * q_draft >= p_draft) & _within(lengths, width, p.device)
    counts = kept.long().cumprod(-1).sum(-1)
    dist = p[rows, counts]  # the bonus's p where every draft was kept
    if width:
        rejected = counts < torch.tensor(lengths, device=p.device)
        q_rejected = _draft_dist(q, drafts, counts.clamp_max(width - 1), p)
        dist = torch.where(rejected[:, None], _residual(dist, q_rejected), dist)
    return Accepted(counts, _emitted(drafts, counts, _draw(dist, generators)))


def accept_trees_greedy(tokens: torch.Tensor, parents: list[list[int]], target_tokens: torch.Tensor) -> Accepted:
    """tokens [B, N] with parents[i] (row i's first len(parents[i]) nodes), target_tokens [B, N+1]
    (argmax after the root, then after each node): at each node the first child equal to the argmax."""
    kids, branching = _children_table(parents, tokens.shape[1], tokens.device)
    rows = torch.arange(len(parents), device=tokens.device)
    at = torch.zeros_like(rows)  # position in target_tokens: 0 the root, j+1 node j
    walking = torch.ones_like(rows, dtype=torch.bool)
    path = torch.full((len(parents), len(branching)), -1, dtype=torch.long, device=tokens.device)
    for depth in range(len(branching)):
        candidates = kids[rows, at]  # [B, K]
        want = target_tokens[rows, at]
        matches = walking[:, None] & (candidates >= 0) & (tokens.gather(1, candidates.clamp_min(0)) == want[:, None])
        walking = matches.any(-1)
        first = candidates.gather(1, matches.long().argmax(-1, keepdim=True)).squeeze(1)  # argmax: the first match
        path[:, depth] = torch.where(walking, first, -1)
        at = torch.where(walking, first + 1, at)
    counts = (path >= 0).sum(-1)
    return Accepted(counts, _emitted(tokens.gather(1, path.clamp_min(0)), counts, target_tokens[rows, at]), path)


def accept_trees_sampled(
    tokens: torch.Tensor, parents: list[list[int]], p: torch.Tensor, q: torch.Tensor | None, generators: list[torch.Generator]
) -> Accepted:
    """tokens [B, N] with parents[i], each drawn from q [B, N, V] (None: deterministic, q one-hot), p [B, N+1, V]
    (the target after the root, then after each node); generators[i] draws row i's uniforms (one per node, each
    node being tried at most once), then its emitted token."""
    kids, branching = _children_table(parents, tokens.shape[1], tokens.device)
    rows = torch.arange(len(parents), device=p.device)
    uniforms = _uniforms(generators, [len(row) for row in parents], tokens.shape[1], p.device)
    at = torch.zeros_like(rows)  # position in p: 0 the root, j+1 node j
    walking = torch.ones_like(rows, dtype=torch.bool)
    dist = p[:, 0]  # what the next token is judged against: p at `at`, less the siblings rejected so far
    path = torch.full((len(parents), len(branching)), -1, dtype=torch.long, device=p.device)
    for depth, siblings in enumerate(branching):
        chosen = torch.full_like(rows, -1)
        for k in range(siblings):
            child = kids[rows, at, k]
            trying = walking & (chosen < 0) & (child >= 0)
            node = child.clamp_min(0)
            x = tokens[rows, node]
            q_child = _draft_dist(q, tokens, node, p)
            keep = trying & (uniforms[rows, node] * q_child[rows, x] < dist[rows, x])
            chosen = torch.where(keep, child, chosen)
            dist = torch.where((trying & ~keep)[:, None], _residual(dist, q_child), dist)
        walking = chosen >= 0
        path[:, depth] = chosen
        at = torch.where(walking, chosen + 1, at)
        dist = torch.where(walking[:, None], p[rows, at], dist)
    counts = (path >= 0).sum(-1)
    return Accepted(counts, _emitted(tokens.gather(1, path.clamp_min(0)), counts, _draw(dist, generators)), path)


def _within(lengths: list[int], width: int, device: torch.device) -> torch.Tensor:
    """[B, width] bool: position j of row i is one of its lengths[i] drafts."""
    return torch.arange(width, device=device) < torch.tensor(lengths, device=device)[:, None]


def _uniforms(generators: list[torch.Generator], counts: list[int], width: int, device: torch.device) -> torch.Tensor:
    """[B, width]: row i's first counts[i] from one draw on generators[i]; the padding is never read."""
    uniforms = torch.ones(len(counts), width, device=device)
    for i, (generator, count) in enumerate(zip(generators, counts)):
        uniforms[i, :count] = torch.rand(count, generator=generator, device=device)
    return uniforms


def _draw(dist: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of dist [B, V], row i's from generators[i]: [B]."""
    if not generators:
        return torch.zeros(0, dtype=torch.long, device=dist.device)
    return torch.cat([sample(dist[i : i + 1], generator) for i, generator in enumerate(generators)])


def _draft_dist(q: torch.Tensor | None, tokens: torch.Tensor, at: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """[B, V]: the q row i's draft token at[i] was drawn from (one-hot of the token when deterministic)."""
    rows = torch.arange(len(at), device=at.device)
    if q is not None:
        return q[rows, at]
    return torch.nn.functional.one_hot(tokens[rows, at], p.shape[-1]).to(p.dtype)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) per row of [B, V]; p itself where round-off left no mass (p(x) < q(x) at a
    rejection, so it has some)."""
    residual = (p - q).clamp_min(0)
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / total, p)


def _emitted(kept: torch.Tensor, counts: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """[B, D+1]: row i's first counts[i] of kept [B, D], then next_tokens[i]; what follows is padding."""
    emitted = torch.cat([kept, next_tokens[:, None]], dim=1)
    return emitted.scatter(1, counts[:, None], next_tokens[:, None])


def _children_table(parents: list[list[int]], nodes: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """kids [B, N+1, K] (at [i, j+1] node j's children in order, at [i, 0] the root's; -1 padding) and, per
    depth below the root, the most children any node at that depth has: the walk's loop counts."""
    rows = [children(row) for row in parents]
    widest = max((len(kids) for row in rows for kids in row), default=0)
    table = torch.full((len(parents), nodes + 1, widest), -1, dtype=torch.long)
    branching: list[int] = []
    for i, (row, row_parents) in enumerate(zip(rows, parents)):
        node_depths = [0] + depths(row_parents)  # the root's 0, then each node's
        for at, kids in enumerate(row):
            if kids:
                table[i, at, : len(kids)] = torch.tensor(kids, dtype=torch.long)
                depth = node_depths[at]
                branching += [0] * (depth + 1 - len(branching))
                branching[depth] = max(branching[depth], len(kids))
    return table.to(device), branching
