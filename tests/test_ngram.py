"""n-gram trees: the latest matches' continuations, deduplicated into one tree, verified exactly."""

from __future__ import annotations

import pytest

from specdec_core.drafters.ngram import NgramDrafter, lookup
from specdec_core.engine import SAMPLING_RULES
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence
from specdec_core.tree import depths

from .helpers import single_thread, tiny_runner  # noqa: F401  (single_thread: autouse, torch on one thread)
from .test_exactness import ALPHA, PARAMS, ROWS, VOCAB, exact, generate, pvalues

# (1, 8) occurs twice before the end, continued by 7, 9 and by 3, 5.
PROMPT = [1, 8, 7, 9, 1, 8, 3, 5, 1, 8]
# For the exactness of trees: the likeliest first tokens (drawn from the prefill's logits; 0 and 3 above all) recur in
# it with other tokens after them, so the first step's lookups are trees of siblings, often but not always kept.
TREE_PROMPT = [4, 3, 9, 3, 3, 0, 2, 6, 0]


def test_lookup_returns_the_latest_matches_continuations_most_recent_first():
    assert lookup(PROMPT, 1, 2, 3, candidates=5) == [[3, 5, 1], [7, 9, 1]]
    assert lookup(PROMPT, 1, 2, 3) == [[3, 5, 1]]
    assert lookup([4, 2, 4, 2, 4], 1, 2, 2, candidates=5) == [[2, 4]]  # the longest n with a match wins
    assert lookup([1, 2, 3], 1, 2, 4, candidates=3) == []


def test_a_tree_of_candidates_shares_common_prefixes():
    tokens = [5, 1, 2, 9, 5, 1, 3, 9, 5, 1, 2, 8, 5]
    proposal = NgramDrafter(1, 1, 3, candidates=3).propose([Sequence("s", tokens, SamplingParams(), 8)], gamma=3)
    nodes, parents = proposal.tokens[0, : proposal.lengths[0]].tolist(), proposal.parents[0]
    paths = set()
    for leaf in range(len(nodes)):
        if leaf not in parents:
            path, at = [], leaf
            while at >= 0:
                path.insert(0, nodes[at])
                at = parents[at]
            paths.add(tuple(path))
    # The continuations 1, 2, 8 / 1, 3, 9 / 1, 2, 9 share their 1 (and 1, 2): six nodes, not nine.
    assert paths == {(1, 2, 8), (1, 3, 9), (1, 2, 9)} and len(nodes) == 6 and max(depths(parents)) == 3


def test_one_candidate_proposes_a_chain():
    proposal = NgramDrafter(1, 2, 3).propose([Sequence("s", PROMPT, SamplingParams(), 8)], gamma=3)
    assert proposal.parents is None and proposal.tokens[0].tolist() == [3, 5, 1]


@pytest.mark.parametrize("rule", SAMPLING_RULES)
def test_ngram_trees_sample_as_the_target_does(rule):
    target = tiny_runner(seed=0, vocab=VOCAB)
    tokens, seqs = generate(target, NgramDrafter(1, 2, 3, candidates=4), TREE_PROMPT, PARAMS["t1"], ROWS, rule)
    drafted = sum(seq.stats.draft_tokens for seq in seqs)
    accepted = sum(seq.stats.accepted_tokens for seq in seqs)
    assert drafted >= ROWS and 0.05 * drafted < accepted < 0.95 * drafted, (drafted, accepted)
    result = pvalues(tokens, exact(target, TREE_PROMPT, PARAMS["t1"]))
    assert min(result.values()) > ALPHA, result
