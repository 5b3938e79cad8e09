"""Exact acceptance rules: what a target keeps of a drafter's proposal.

Sampled (Leviathan et al. 2023; Chen et al. 2023): draft token x, drawn from q,
is kept with probability min(1, p(x) / q(x)); at the first rejection the
replacement is drawn from norm(max(0, p - q)); when all are kept a bonus token
is drawn from p. The emitted tokens are then distributed exactly as sampling
from p token by token. Greedy: keep the longest prefix equal to the target's
argmax, then the target's own next token.
"""

from __future__ import annotations

import torch

from .sampling import sample


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
    residual = (p[j] - q_j).clamp_min(0)
    total = residual.sum()
    # p(x) < q(x) at a rejection, so the residual has mass; guard against float round-off all the same.
    residual = residual / total if total > 0 else p[j]
    return j, draft[:j].tolist() + [int(sample(residual[None], generator))]
