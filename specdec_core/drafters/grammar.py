"""The grammar drafter: a row's forced continuation first, the configured drafter after it.

Where a row's grammar spells one continuation (a JSON key, the braces and
quotes around it, a tool call's opening), those tokens are drafted with
probability 1 (q one-hot), so forced structure costs a verify slot, not a
step. The configured drafter then continues from there when it drafts from
the text alone (suffix, n-gram: `Drafter.drafts_from_text`). A model
drafter's state holds committed tokens only, so a row with forced tokens
proposes those alone and its model row is told it kept nothing, to catch up
next time (as the hybrid does). The forced tokens are a draft like any other
for the acceptance rule, which keeps them only where the target would have
said them (it may split the same text into other tokens); they are counted
apart (`Proposal.forced`), so no drafter's acceptance figure and no gamma
sees them.
"""

from __future__ import annotations

import torch

from ..sequence import Sequence
from ..tree import within_depth
from .base import Drafter, Proposal


def propose(drafter: Drafter, seqs: list[Sequence], gamma: int, most: int, budgets: list[int]) -> Proposal:
    """Each row's forced tokens (rows with a grammar; at most `most`, and its budget), then the drafter's proposal
    of up to gamma tokens (the controller's choice: the forced ones are drafted whatever it is; 0 asks nothing
    of the drafter)."""
    forced = [seq.grammar.forced(min(most, budget)) if seq.grammar is not None else [] for seq, budget in zip(seqs, budgets)]
    if not any(forced):
        return drafter.propose(seqs, gamma) if gamma else nothing(len(seqs))
    continues = drafter.drafts_from_text
    if not gamma:
        own = nothing(len(seqs))
    else:
        own = drafter.propose(seqs, gamma, pending=forced) if continues else drafter.propose(seqs, gamma)
    rows = []  # per row: (tokens, parents, origin)
    for i, lead in enumerate(forced):
        n = own.lengths[i]
        own_parents = own.parents[i][:n] if own.parents is not None else list(range(-1, n - 1))
        if not lead:
            nodes = list(range(n))
        elif continues:
            nodes = within_depth(own_parents, min(gamma, budgets[i] - len(lead)))
        else:
            nodes = []
        index = {j: k for k, j in enumerate(nodes)}
        chain = list(range(-1, len(lead) - 1))  # the forced tokens, one after another
        after = [len(lead) + index[own_parents[j]] if own_parents[j] >= 0 else len(lead) - 1 for j in nodes]
        tokens = lead + own.tokens[i, nodes].tolist()
        rows.append((tokens, chain + after, [-1] * len(lead) + nodes))
    width = max(len(tokens) for tokens, _, _ in rows)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    probs = None if own.probs is None else own.probs.new_zeros(len(seqs), width, own.probs.shape[-1])
    for i, (row_tokens, _, origin) in enumerate(rows):
        tokens[i, : len(row_tokens)] = torch.tensor(row_tokens, dtype=torch.long)
        if probs is not None:
            lead = len(forced[i])
            probs[i, torch.arange(lead), tokens[i, :lead].to(probs.device)] = 1.0  # a deterministic draft: q one-hot
            probs[i, lead : len(row_tokens)] = own.probs[i, origin[lead:]]
    return Proposal(
        tokens, [len(row_tokens) for row_tokens, _, _ in rows], probs,
        parents=[parents for _, parents, _ in rows] if own.parents is not None else None,
        forced=[len(lead) for lead in forced], origin=[origin for _, _, origin in rows], own=own,
    )


def nothing(rows: int) -> Proposal:
    """The proposal of a step that drafts nothing."""
    return Proposal(tokens=torch.zeros(rows, 0, dtype=torch.long), lengths=[0] * rows, probs=None)


def own_paths(proposal: Proposal, paths: list[list[int]]) -> tuple[Proposal, list[list[int]]]:
    """The drafter's own proposal, and each row's kept nodes numbered as in it (the grammar's left out)."""
    if proposal.own is None:
        return proposal, paths
    return proposal.own, [[origin[j] for j in path if origin[j] >= 0] for origin, path in zip(proposal.origin, paths)]
