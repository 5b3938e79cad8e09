"""Exact acceptance rules: what a target keeps of a drafter's proposal.

Sampled (Leviathan et al. 2023; Chen et al. 2023): draft token x, drawn from q,
is kept with probability min(1, p(x) / q(x)); at the first rejection the
replacement is drawn from norm(max(0, p - q)); when all are kept a bonus token
is drawn from p. The emitted tokens are then distributed exactly as sampling
from p token by token. Greedy: keep the longest prefix equal to the target's
argmax, then the target's own next token.

Trees (SpecInfer, Miao et al. 2024): walk down from the root; at each node try
its children in order, keeping child x with probability min(1, p(x) / q(x))
and on a rejection replacing p by norm(max(0, p - q)) before the next sibling.
Siblings are either drawn independently from one q, or distinct deterministic
tokens (q one-hot, so a rejection just removes x from p). When no child is
kept the token is drawn from what is left of p. Greedy trees follow the
target's argmax down the tree.
"""

from __future__ import annotations

import torch

from .sampling import sample
from .tree import children


def verify_greedy(draft: torch.Tensor, target_tokens: torch.Tensor) -> tuple[int, list[int]]:
    """draft [g], target_tokens [g+1] (argmax after each prefix) -> (accepted, emitted tokens)."""
    g = len(draft)
    mismatch = (draft != target_tokens[:g]).nonzero()
    accepted = int(mismatch[0]) if len(mismatch) else g
    return accepted, draft[:accepted].tolist() + [int(target_tokens[accepted])]


def verify_sampled(
    draft: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator
) -> tuple[int, list[int]]:
    """draft [g] drawn from q [g, V] (None: each draft token had q = 1), p [g+1, V] -> (accepted, emitted)."""
    g = len(draft)
    positions = torch.arange(g, device=p.device)
    p_draft = p[positions, draft]
    q_draft = q[positions, draft] if q is not None else torch.ones_like(p_draft)
    u = torch.rand(g, generator=generator, device=p.device)
    rejected = (u * q_draft >= p_draft).nonzero()
    if not len(rejected):
        return g, draft.tolist() + [int(sample(p[g : g + 1], generator))]
    j = int(rejected[0])
    q_j = q[j] if q is not None else torch.nn.functional.one_hot(draft[j], p.shape[-1]).to(p.dtype)
    return j, draft[:j].tolist() + [int(sample(_residual(p[j], q_j)[None], generator))]


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); p itself if round-off left no mass (p(x) < q(x) at a rejection, so it has some)."""
    residual = (p - q).clamp_min(0)
    total = residual.sum()
    return residual / total if total > 0 else p


def verify_tree_greedy(tokens: torch.Tensor, parents: list[int], target_tokens: torch.Tensor) -> tuple[list[int], list[int]]:
    """tokens [N] with parents, target_tokens [N+1] (argmax after the root, then after each node)
    -> (kept node indices root to leaf, emitted tokens)."""
    kids = children(parents)
    path: list[int] = []
    at = 0  # row in target_tokens: 0 the root, j+1 node j
    while True:
        want = int(target_tokens[at])
        match = next((j for j in kids[at] if int(tokens[j]) == want), None)
        if match is None:
            return path, tokens[path].tolist() + [want]
        path.append(match)
        at = match + 1


def verify_tree_sampled(
    tokens: torch.Tensor, parents: list[int], q: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator
) -> tuple[list[int], list[int]]:
    """tokens [N] with parents, each drawn from q [N, V] (None: deterministic, q one-hot), p [N+1, V]
    (the target after the root, then after each node) -> (kept node indices, emitted tokens)."""
    kids = children(parents)
    path: list[int] = []
    at = 0
    while True:
        dist = p[at]
        for j in kids[at]:
            x = int(tokens[j])
            q_j = q[j] if q is not None else torch.nn.functional.one_hot(tokens[j], p.shape[-1]).to(p.dtype)
            u = float(torch.rand(1, generator=generator, device=p.device))
            if u * float(q_j[x]) < float(dist[x]):
                path.append(j)
                at = j + 1
                break
            dist = _residual(dist, q_j)
        else:
            return path, tokens[path].tolist() + [int(sample(dist[None], generator))]
