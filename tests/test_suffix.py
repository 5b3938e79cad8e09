"""The suffix drafter: its memory (incremental updates equal a rebuild, the bound, LRU eviction, per-client
isolation), its continuation trees, and its proposals through the real engine: greedy equals plain, and
sampling passes the chi-square test that a wrong sibling rule fails."""

from __future__ import annotations

import random

import pytest

from specdec_core import engine as engine_module
from specdec_core.control import Controller
from specdec_core.drafters.suffix import KEY, SuffixDrafter, TokenMemory
from specdec_core.engine import SAMPLING_RULES, Engine
from specdec_core.models.loading import eos_ids
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence
from specdec_core.tree import continuation_tree, depths

from .helpers import (
    single_thread,  # noqa: F401  (autouse: torch on one thread)
    tiny_runner,
)
from .test_engine import (  # noqa: F401  (fixtures)
    TINY_LONGEST,
    assert_rows_match,
    run_rows,
    speculation,
    tiny_prompts,
    tiny_references,
    tiny_target,
)
from .test_exactness import ALPHA, PARAMS, ROWS, VOCAB, exact, generate, pvalues
from .test_tree import no_sibling_residual


def live_index(memory: TokenMemory) -> dict[tuple[int, ...], list[tuple[int, int]]]:
    """The index without the entries of evicted documents (which lookups skip)."""
    live = {key: [entry for entry in entries if entry[0] in memory.documents] for key, entries in memory.index.items()}
    return {key: entries for key, entries in live.items() if entries}


def rebuilt(memory: TokenMemory) -> dict[tuple[int, ...], list[tuple[int, int]]]:
    """The index a rebuild from the live documents gives."""
    index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for document in memory.documents.values():
        for end in range(KEY, len(document.tokens) + 1):
            index.setdefault(tuple(document.tokens[end - KEY : end]), []).append((document.id, end))
    return index


def test_incremental_updates_equal_a_rebuild():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(400)]  # a small vocabulary: many repeats
    incremental, whole = TokenMemory(), TokenMemory()
    doc = incremental.add("a")
    at = 0
    while at < len(tokens):
        step = rng.randint(1, 7)
        incremental.extend(doc, tokens[at : at + step])
        at += step
    whole.add("a", tokens)
    assert dict(incremental.index) == dict(whole.index) == rebuilt(whole)
    for cut in range(KEY, len(tokens), 37):
        context = tokens[:cut] + [rng.randrange(6)]
        assert incremental.matches(context, "a", False, 16) == whole.matches(context, "a", False, 16)


def test_the_longest_match_wins_and_each_of_its_occurrences_votes():
    memory = TokenMemory()
    memory.add(None, [1, 2, 3, 4, 9, 2, 3, 5, 0, 2, 3, 4, 7])
    length, found = memory.matches([8, 3, 4, 2, 3, 4], None, True, 8)
    assert length == 3  # 2 3 4, twice; the match 3 4 2 3 4 is nowhere
    assert sorted(document.tokens[start] for document, start in found) == [7, 9]
    assert memory.matches([1, 2, 3, 4, 7], None, True, 8) == (0, [])  # a bigram (4, 7) at the document's end only
    length, found = memory.matches([1, 2, 3], None, True, 2)
    assert length == 2 and len(found) == 3  # max_match caps the match: 2 3 occurs three times


def test_eviction_keeps_the_memory_within_its_bound_and_drops_the_least_recently_used():
    rng = random.Random(1)
    memory = TokenMemory(max_tokens=500)
    for i in range(300):
        memory.add(f"client{i % 3}", [rng.randrange(20) for _ in range(rng.randint(1, 80))])
        assert memory.size == sum(len(d.tokens) for d in memory.documents.values()) <= 500
        assert live_index(memory) == rebuilt(memory)
        assert memory.stale <= memory.size + 80  # rebuilt before stale entries outnumber the live ones by more
    assert len(memory.add("big", list(range(2000))) and memory.documents) == 1  # longer than the bound: its tail
    assert memory.size == 500

    memory = TokenMemory(max_tokens=30)
    old, newer = memory.add(None, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), memory.add(None, [11, 12, 13, 14, 15, 16, 17, 18, 19, 20])
    assert memory.matches([0, 1, 2], None, True, 8)[0] == 2  # a match makes the older document the most recent
    memory.add(None, list(range(30, 40)))  # 30 tokens: nothing leaves yet
    memory.add(None, [41, 42, 43])  # past the bound: the least recently used leaves, which is `newer`
    assert old in memory.documents and newer not in memory.documents


def test_clients_draft_only_from_their_own_outputs_unless_shared():
    memory = TokenMemory()
    memory.add("alice", [5, 6, 7, 8, 9])
    assert memory.matches([1, 6, 7], "bob", False, 8) == (0, [])
    assert memory.matches([1, 6, 7], "alice", False, 8)[0] == 2
    assert memory.matches([1, 6, 7], "bob", True, 8)[0] == 2


def test_the_continuation_tree_takes_the_best_supported_nodes_parents_first():
    continuations = [[7, 9, 4], [7, 9, 4], [3, 5], [7, 1]]
    tokens, parents = continuation_tree(continuations, max_nodes=10, min_probability=0.0)
    assert tokens[:2] == [7, 9] and parents[:2] == [-1, 0]  # 7 has 3 of 4 votes, 9 below it 2 of 4
    assert sorted(zip(tokens, parents)) == sorted([(7, -1), (9, 0), (4, 1), (3, -1), (5, 3), (1, 0)])
    assert all(parent < j for j, parent in enumerate(parents))
    for parent in set(parents):  # siblings are distinct tokens: q is one-hot, the tree rule's deterministic case
        siblings = [t for t, p in zip(tokens, parents) if p == parent]
        assert len(siblings) == len(set(siblings))
    assert continuation_tree(continuations, max_nodes=10, min_probability=0.5) == ([7, 9, 4], [-1, 0, 1])
    assert continuation_tree(continuations, max_nodes=2, min_probability=0.0) == ([7, 9], [-1, 0])
    assert continuation_tree([], max_nodes=4, min_probability=0.0) == ([], [])


def test_a_longer_match_earns_a_larger_tree():
    drafter = SuffixDrafter(max_tokens=1000, factor=1.0, min_probability=0.0)
    text = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 9, 9, 9, 3, 4, 5, 6, 7]
    drafter.global_memory.add(None, text)
    short = Sequence("short", [0, 1, 2], SamplingParams(), 8)
    long = Sequence("long", [2, 3, 4, 5, 6], SamplingParams(), 8)
    for seq in (short, long):
        drafter.add(seq)
    proposal = drafter.propose([short, long], gamma=8)
    assert proposal.lengths == [2, 5]  # factor 1: as many nodes as the match is long (2, then 5)
    assert max(depths(proposal.parents[1])) <= 8


@pytest.mark.parametrize("gamma", [None, 3], ids=["controller", "fixed-gamma-3"])
def test_suffix_rows_equal_plain_greedy(tiny_target, tiny_prompts, tiny_references, gamma):  # noqa: F811
    engine = Engine(tiny_target, SuffixDrafter(max_tokens=10_000, factor=2.0), Controller(fixed_gamma=gamma), eos_ids(tiny_target))
    seqs, _ = run_rows(engine, tiny_prompts * 2, TINY_LONGEST, temperature=0)
    assert_rows_match(seqs, tiny_references * 2)
    if gamma:
        assert speculation(seqs)[0] > 0


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("second_client", ["alice", "bob"])
def test_a_request_drafts_from_an_earlier_requests_output(tiny_target, tiny_prompts, tiny_references, shared, second_client):  # noqa: F811
    """The same prompt twice, greedy: the second request's output repeats the first's, which the global memory
    holds once the first has left, for the same client or, when shared, for any."""
    engine = Engine(tiny_target, SuffixDrafter(max_tokens=10_000, shared=shared, factor=2.0), Controller(fixed_gamma=4), eos_ids(tiny_target))
    prompt, reference = tiny_prompts[0], tiny_references[0][:TINY_LONGEST]
    first = Sequence("first", list(prompt), SamplingParams(temperature=0), TINY_LONGEST, client="alice")
    second = Sequence("second", list(prompt), SamplingParams(temperature=0), TINY_LONGEST, client=second_client)
    steps = {}
    for seq in (first, second):
        steps[seq.request_id] = len(list(engine.generate([seq])))
        assert seq.output_ids == reference
    if shared or second_client == "alice":
        assert second.stats.accepted_tokens > first.stats.accepted_tokens and steps["second"] < steps["first"]
    else:  # its own memory only, as the first had
        assert (second.stats.accepted_tokens, steps["second"]) == (first.stats.accepted_tokens, steps["first"])


# Two earlier occurrences of the final bigram (1, 8), continued by 7, 9 and by 3, 5: a tree whose root has two
# children, each half the votes, so the tree rule's sibling residuals run.
# The likeliest first tokens (drawn from the prefill's logits) recur in it with other tokens after them, so the first
# step's drafts are trees of siblings, often but not always kept.
EXACTNESS_PROMPT = [4, 3, 9, 3, 3, 0, 2, 6, 0]


@pytest.mark.parametrize("rule", SAMPLING_RULES)
def test_suffix_trees_sample_as_the_target_does(rule):
    target = tiny_runner(seed=0, vocab=VOCAB)
    drafter = SuffixDrafter(max_tokens=1000, factor=2.0, min_probability=0.0)
    tokens, seqs = generate(target, drafter, EXACTNESS_PROMPT, PARAMS["t1"], ROWS, rule)
    drafted = sum(seq.stats.draft_tokens for seq in seqs)
    accepted = sum(seq.stats.accepted_tokens for seq in seqs)
    # Kept and rejected, thousands of times (the first step's trees, after the first token: drafts for most rows).
    assert drafted >= ROWS // 2 and 0.05 * drafted < accepted < 0.95 * drafted, (drafted, accepted)
    result = pvalues(tokens, exact(target, EXACTNESS_PROMPT, PARAMS["t1"]))
    assert min(result.values()) > ALPHA, result


def test_negative_control_suffix_trees_under_a_wrong_sibling_rule_fail(monkeypatch):
    monkeypatch.setattr(engine_module, "accept_trees_sampled", no_sibling_residual)
    target = tiny_runner(seed=0, vocab=VOCAB)
    drafter = SuffixDrafter(max_tokens=1000, factor=2.0, min_probability=0.0)
    tokens, _ = generate(target, drafter, EXACTNESS_PROMPT, PARAMS["t1"], ROWS, "rejection")
    result = pvalues(tokens, exact(target, EXACTNESS_PROMPT, PARAMS["t1"]))
    assert min(result.values()) < ALPHA * 1e-3, result
