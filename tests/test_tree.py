"""Token trees: the tree pass equals chain passes, and tree verification keeps decoding exact.

Two test-double drafters propose fixed-shape trees through the real Engine:
one with deterministic distinct siblings (the target's likeliest tokens, as
Medusa and EAGLE propose them, q one-hot), one with siblings drawn
independently from a fixed q (SpecInfer's multi-draft case). Both must leave
greedy output equal to plain greedy decoding and sampled output distributed
as the target's, by the chi-square harness of test_exactness.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec_core import engine as engine_module
from specdec_core.control import Controller
from specdec_core.drafters.base import Drafter, Proposal
from specdec_core.engine import Engine
from specdec_core.models.runner import BatchCache
from specdec_core.sampling import SamplingParams, sample
from specdec_core.sequence import Sequence
from specdec_core.tree import ancestors_mask, batch_layout, children, depths, path_counts, within_depth
from specdec_core.verify import Accepted, accept_trees_greedy, accept_trees_sampled

from .helpers import decode, full_logits, greedy_reference, tiny_runner
from .helpers import single_thread  # noqa: F401  (autouse: torch on one thread)
from .test_exactness import ALPHA, PARAMS, ROWS, VOCAB, exact, generate, pvalues

# A tree of 6 nodes, depth 3: the root's children 0 and 1; 0's children 2 and 3; 2's child 4; 1's child 5.
PARENTS = [-1, -1, 0, 0, 2, 1]
PROMPT = [1, 2, 3, 4, 5]


def test_layout_of_a_tree():
    assert depths(PARENTS) == [1, 1, 2, 2, 3, 2]
    assert children(PARENTS) == [[0, 1], [2, 3], [5], [4], [], [], []]
    mask = ancestors_mask(PARENTS)
    # Node 4 (row 5) sees the root, node 0, node 2 and itself, nothing else.
    assert mask[5].nonzero().squeeze(1).tolist() == [0, 1, 3, 5]
    batched, offsets = batch_layout([PARENTS, [-1]], width=len(PARENTS))
    assert torch.equal(batched[0], mask) and offsets[0].tolist() == [0, 1, 1, 2, 2, 3, 2]
    # A one-node row padded to the batch's width: padding sees the root and itself only.
    assert offsets[1].tolist() == [0, 1, 0, 0, 0, 0, 0]
    assert batched[1, 3].nonzero().squeeze(1).tolist() == [0, 3]


def test_path_counts_follow_each_nodes_path():
    tokens = torch.tensor([7, 8, 7, 9, 7, 8])
    counts = path_counts(torch.zeros(12), tokens, PARENTS, 12)
    assert counts[0].sum() == 0
    assert counts[5][7] == 3 and counts[5].sum() == 3  # node 4: 7 -> 7 -> 7
    assert counts[6][8] == 2 and counts[6].sum() == 2  # node 5: 8 -> 8
    assert path_counts(None, tokens, PARENTS, 12) is None


def test_a_tree_pass_gives_each_node_its_chain_logits():
    """Two rows of different lengths and trees in one pass; every node's logits equal a chain pass over its path."""
    runner = tiny_runner(seed=0)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]
    trees = [(PARENTS, [11, 12, 13, 14, 15, 16]), ([-1, 0, 0], [21, 22, 23])]
    cache = BatchCache.empty(runner.device)
    for prompt in prompts:
        cache.append(runner.prefill(prompt[:-1])[0])
    width = max(len(parents) for parents, _ in trees)
    ids = torch.zeros(2, width + 1, dtype=torch.long)
    for i, (prompt, (parents, tokens)) in enumerate(zip(prompts, trees)):
        ids[i, 0] = prompt[-1]
        ids[i, 1 : 1 + len(tokens)] = torch.tensor(tokens)
    mask, offsets = batch_layout([parents for parents, _ in trees], width)
    logits, _ = runner.forward(cache, ids, tree_mask=mask, depths=offsets)
    for i, (prompt, (parents, tokens)) in enumerate(zip(prompts, trees)):
        for j in range(len(tokens)):
            path, at = [], j
            while at >= 0:
                path.insert(0, tokens[at])
                at = parents[at]
            torch.testing.assert_close(logits[i, j + 1], full_logits(runner, prompt + path)[-1], rtol=1e-4, atol=1e-4)


class FixedTreeDrafter(Drafter):
    """Test double: every row proposes the same tree, deterministic tokens (q one-hot) or drawn from a fixed q."""

    name = "fixed-tree"

    def __init__(self, parents: list[int], tokens: list[int] | None = None, q: torch.Tensor | None = None, seed: int = 0):
        self.parents, self.tokens, self.q = parents, tokens, q
        self.generator = torch.Generator().manual_seed(seed)
        self.seen_paths: list[list[int]] = []

    def propose(self, seqs: list[Sequence], gamma: int) -> Proposal:
        batch, nodes = len(seqs), len(self.parents)
        if self.q is None:
            tokens = torch.tensor(self.tokens).expand(batch, nodes).clone()
            probs = None
        else:
            tokens = sample(self.q.expand(batch * nodes, -1), self.generator).view(batch, nodes)
            probs = self.q.expand(batch, nodes, -1)
        return Proposal(tokens=tokens, lengths=[nodes] * batch, probs=probs, parents=[self.parents] * batch)

    def accepted(self, seqs, proposal, paths, features) -> None:
        self.seen_paths.extend(paths)


def likely_tree(target, prompt: list[int]) -> list[int]:
    """Tokens for PARENTS that the target often accepts: each node a likely token after its path."""
    want = exact(target, prompt, SamplingParams(temperature=1.0))
    first = np.argsort(want.first)[::-1]
    after = lambda x: np.argsort(want.pair[x])[::-1]  # noqa: E731  (likeliest second tokens after x)
    a, b = int(first[0]), int(first[1])
    return [a, b, int(after(a)[0]), int(after(a)[1]), int(first[2]), int(after(b)[0])]


@pytest.fixture(scope="module")
def target():
    return tiny_runner(seed=0, vocab=VOCAB)


def fixed_q(seed: int = 3) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)).softmax(-1)


@pytest.mark.parametrize("rule", engine_module.SAMPLING_RULES)
@pytest.mark.parametrize("setting", list(PARAMS))
@pytest.mark.parametrize("siblings", ["deterministic", "sampled"])
def test_tree_sampling_is_distributed_as_the_target(target, siblings, setting, rule):
    params = PARAMS[setting]
    drafter = (
        FixedTreeDrafter(PARENTS, likely_tree(target, PROMPT)) if siblings == "deterministic"
        else FixedTreeDrafter(PARENTS, q=fixed_q())
    )
    tokens, seqs = generate(target, drafter, PROMPT, params, ROWS, rule)
    kept = [len(path) for path in drafter.seen_paths]
    # Paths of every length the budget allows were kept (3 tokens: depth 2, then 1): the whole walk ran.
    assert {0, 1, 2} <= set(kept), np.bincount(kept)
    result = pvalues(tokens, exact(target, PROMPT, params))
    assert min(result.values()) > ALPHA, result


def no_sibling_residual(tokens, parents, p, q, generators) -> Accepted:
    """A wrong rule: try each sibling against the untouched p, not the residual the last rejection left."""
    paths, emitted = [], []
    for i, (row, generator) in enumerate(zip(parents, generators)):
        kids, path, at = children(row), [], 0
        while True:
            for j in kids[at]:
                x = int(tokens[i, j])
                q_x = float(q[i, j, x]) if q is not None else 1.0
                if float(torch.rand(1, generator=generator)) * q_x < float(p[i, at, x]):
                    path.append(j)
                    at = j + 1
                    break
            else:
                break
        paths.append(path)
        emitted.append(tokens[i, path].tolist() + [int(sample(p[i, at][None], generator))])
    depth = max(map(len, paths), default=0)
    return Accepted(
        torch.tensor([len(path) for path in paths]),
        torch.tensor([row + [0] * (depth + 1 - len(row)) for row in emitted]),
        torch.tensor([path + [-1] * (depth - len(path)) for path in paths]).view(len(paths), depth),
    )


def test_negative_control_a_wrong_sibling_rule_fails(target, monkeypatch):
    monkeypatch.setattr(engine_module, "accept_trees_sampled", no_sibling_residual)
    params = PARAMS["t1"]
    tokens, _ = generate(target, FixedTreeDrafter(PARENTS, likely_tree(target, PROMPT)), PROMPT, params, ROWS // 2, "rejection")
    result = pvalues(tokens, exact(target, PROMPT, params))
    assert min(result.values()) < ALPHA * 1e-3, result


def kept(accepted: Accepted, row: int) -> tuple[list[int], list[int]]:
    """(kept nodes, emitted tokens) of one row of a batched result."""
    n = int(accepted.counts[row])
    return accepted.path[row, :n].tolist(), accepted.tokens[row, : n + 1].tolist()


def test_trees_of_a_batch_keep_a_sure_path_and_draw_the_bonus_after_it():
    # Row 0: after the root the target is sure of 2 (node 1), after node 1 of 3 (no child): the bonus.
    # Row 1, PARENTS: sure of node 1's token 8, then of node 5's 9 (a leaf), then of 4.
    p = torch.zeros(2, len(PARENTS) + 1, 10)
    p[0, 0, 2] = p[0, 2, 3] = 1.0
    p[1, 0, 8] = p[1, 2, 9] = p[1, 6, 4] = 1.0
    tokens = torch.tensor([[1, 2, 0, 0, 0, 0], [7, 8, 1, 1, 1, 9]])
    for q in (None, torch.full((2, len(PARENTS), 10), 0.1)):
        generators = [torch.Generator().manual_seed(seed) for seed in (0, 1)]
        result = accept_trees_sampled(tokens, [[-1, -1], PARENTS], p, q, generators)
        assert kept(result, 0) == ([1], [2, 3]) and kept(result, 1) == ([1, 5], [8, 9, 4])


def test_greedy_trees_of_a_batch_follow_the_first_child_equal_to_the_argmax():
    tokens = torch.tensor([[7, 8, 5, 5, 6, 9], [3, 3, 4, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    parents = [PARENTS, [-1, -1, 1], []]
    targets = torch.zeros(3, len(PARENTS) + 1, dtype=torch.long)
    targets[0, [0, 1, 3, 5]] = torch.tensor([7, 5, 6, 2])  # root -> node 0 -> node 2 (first of the two 5s) -> node 4
    targets[1, [0, 1]] = torch.tensor([3, 4])  # node 0 (of two 3s), which has no child 4: the target's 4 follows
    targets[2, 0] = 1  # no nodes: plain decoding
    result = accept_trees_greedy(tokens, parents, targets)
    assert [kept(result, i) for i in range(3)] == [([0, 2, 4], [7, 5, 6, 2]), ([0], [3, 4]), ([], [1])]


@pytest.mark.parametrize("siblings", ["deterministic", "sampled"])
def test_greedy_tree_decoding_equals_plain_greedy(siblings):
    target = tiny_runner(seed=0)
    prompt = [3, 14, 15, 9, 26, 5]
    reference = greedy_reference(target, prompt, 24)
    # Likely trees for a 64-token random model: the reference's own next tokens on the first branch (the first
    # step's: after the first token, which the prefill's logits draw).
    drafter = (
        FixedTreeDrafter(PARENTS, [reference[1], 1, reference[2], 2, reference[3], 3]) if siblings == "deterministic"
        else FixedTreeDrafter(PARENTS, q=torch.full((target.vocab_size,), 1 / target.vocab_size))
    )
    engine = Engine(target, drafter, Controller(gamma_max=3, fixed_gamma=3), eos_token_ids=set())
    seq = Sequence("r", prompt, SamplingParams(temperature=0), 24)
    decode(engine, [seq])
    assert seq.output_ids == reference
    assert any(drafter.seen_paths)  # something was accepted, so the kept path's cache was reused


def test_a_tree_cut_to_a_depth_keeps_whole_paths():
    assert within_depth(PARENTS, 2) == [0, 1, 2, 3, 5]
    assert within_depth(PARENTS, 0) == []
