"""Token trees: the shape a tree proposal takes in one target pass.

A row's tree is its last token (the root, not yet in the cache) and N draft
nodes in topological order: parents[j] < j is node j's parent, -1 the root.
The target sees the root then the nodes, each attending to the row's cache,
the root and its own ancestors, at rotary position length + depth. A chain is
the tree whose parents are -1, 0, 1, ...
"""

from __future__ import annotations

import heapq

import torch


def ancestors_mask(parents: list[int]) -> torch.Tensor:
    """[N+1, N+1] bool over (root, nodes): entry (a, b) when b is a or an ancestor of a."""
    n = len(parents)
    mask = torch.eye(n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for j, parent in enumerate(parents):
        if parent >= 0:
            mask[j + 1] |= mask[parent + 1]
    return mask


def depths(parents: list[int]) -> list[int]:
    """Each node's depth below the root (the root's children are 1)."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def within_depth(parents: list[int], max_depth: int) -> list[int]:
    """The nodes at depth <= max_depth (with every ancestor, since depth grows down a path)."""
    return [j for j, depth in enumerate(depths(parents)) if depth <= max_depth]


def batch_layout(parents: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4D-mask part and rotary offsets for a batch of trees padded to `width` nodes.

    Returns mask [B, width+1, width+1] and depths [B, width+1] (the root's 0 first).
    Padding nodes see only the root and themselves; nothing keeps them.
    """
    batch = len(parents)
    mask = torch.eye(width + 1, dtype=torch.bool).repeat(batch, 1, 1)
    mask[:, :, 0] = True
    offsets = torch.zeros(batch, width + 1, dtype=torch.long)
    for i, row in enumerate(parents):
        n = len(row)
        mask[i, : n + 1, : n + 1] = ancestors_mask(row)
        offsets[i, 1 : n + 1] = torch.tensor(depths(row), dtype=torch.long)
    return mask, offsets


def children(parents: list[int]) -> list[list[int]]:
    """children(parents)[j + 1] lists node j's children in order; [0] is the root's."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for j, parent in enumerate(parents):
        out[parent + 1].append(j)
    return out


def path_counts(base: torch.Tensor | None, tokens: torch.Tensor, parents: list[int], vocab: int) -> torch.Tensor | None:
    """Token counts before each of (root, nodes...) positions' next token: base plus the tokens on its path.

    Row 0 is base (what the root's logits are judged with); row j+1 adds node j and its ancestors.
    """
    if base is None:
        return None
    counts = base.repeat(len(parents) + 1, 1)
    for j, parent in enumerate(parents):
        counts[j + 1] = counts[parent + 1]
        counts[j + 1, int(tokens[j])] += 1
    return counts


def continuation_tree(continuations: list[list[int]], max_nodes: int, min_probability: float
                      ) -> tuple[list[int], list[int]]:
    """(tokens, parents) of the most supported continuations, best first: each node's support is the share of
    continuations through it, and nodes below min_probability are left out. Parents come before children,
    since a child never has more support than its parent."""
    if not continuations:
        return [], []
    children: list[dict[int, int]] = [{}]  # node 0 is the root
    counts = [len(continuations)]
    node_tokens = [-1]
    for continuation in continuations:
        node = 0
        for token in continuation:
            child = children[node].get(token)
            if child is None:
                child = children[node][token] = len(counts)
                children.append({})
                counts.append(0)
                node_tokens.append(token)
            counts[child] += 1
            node = child
    tokens, parents, position = [], [], {0: -1}
    heap = [(-counts[child], child, 0) for child in children[0].values()]
    heapq.heapify(heap)
    while heap and len(tokens) < max_nodes:
        count, node, parent = heapq.heappop(heap)
        if -count / len(continuations) < min_probability:
            break
        position[node] = len(tokens)
        tokens.append(node_tokens[node])
        parents.append(position[parent])
        for child in children[node].values():
            heapq.heappush(heap, (-counts[child], child, node))
    return tokens, parents
