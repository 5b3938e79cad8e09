"""The model runners and their caches: every cached forward equals one full forward over the same tokens (fp32),
on each step: transformers' forward over the slot cache (eager), ours over the static cache (static), that
compiled (compiled), and ours with passes padded as CUDA graphs take them (padded)."""

import random

import pytest
import torch

from specdec_core.models.runner import BatchCache, ModelRunner
from specdec_core.models.static_cache import BLOCK
from specdec_core.models.static_runner import StaticRunner

from .helpers import full_logits, tiny_runner
from .helpers import single_thread  # noqa: F401  (autouse: torch on one thread)

VOCAB = 64
EMITTED = 9  # a token emitted after a verify step: the next step feeds it first


STEPS = {
    "eager": lambda runner: runner,
    "static": lambda runner: StaticRunner.of(runner, compiled=False),
    "compiled": lambda runner: StaticRunner.of(runner, compiled=True),
    "padded": lambda runner: StaticRunner.of(runner, compiled=False, pad=True),
}


@pytest.fixture(scope="module", params=[(f, s) for f in ("llama", "qwen2") for s in STEPS], ids="-".join)
def runner(request) -> ModelRunner:
    family, step = request.param
    return STEPS[step](tiny_runner(vocab=VOCAB, family=family))


@pytest.fixture
def slot_runner(runner) -> ModelRunner:
    """The runner, for tests of the slot cache's own bookkeeping (the eager step's)."""
    if isinstance(runner, StaticRunner):
        pytest.skip("a slot-cache test: the static cache has no slots to compact or check")
    return runner


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def assert_matches_full(runner: ModelRunner, logits: torch.Tensor, context: list[int]) -> None:
    """logits [k, V] are those of the last k tokens of `context`."""
    expected = full_logits(runner, context)[len(context) - len(logits) :]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def step(runner: ModelRunner, cache: BatchCache, rows: list[list[int]], keep: list[int] | None = None) -> torch.Tensor:
    """Forward one new-token list per row (padded), then keep the first keep[i] of row i (default: all)."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    logits, _ = runner.forward(cache, ids)
    keep = [len(r) for r in rows] if keep is None else keep
    cache.commit(torch.arange(width)[None, :] < torch.tensor(keep)[:, None])
    return logits


def batch(runner: ModelRunner, prompts: list[list[int]]) -> BatchCache:
    """A batch cache holding prompt[:-1] of each row, built as the engine does: prefill, then append."""
    cache = runner.new_cache()
    for prompt in prompts:
        row, logits, _ = runner.prefill(prompt[:-1], all_logits=True)
        if len(prompt) > 1:
            assert_matches_full(runner, logits, prompt[:-1])
        cache.append(row)
    return cache


def test_prefill_logits(runner):
    seq = tokens(6, seed=0)
    _, last, _ = runner.prefill(seq)
    _, every, _ = runner.prefill(seq, all_logits=True)
    assert last.shape == (1, VOCAB) and every.shape == (6, VOCAB)
    assert_matches_full(runner, last, seq)
    assert_matches_full(runner, every, seq)
    cache, logits, _ = runner.prefill([])
    assert logits.shape == (0, VOCAB) and cache.batch_size == 1 and cache.lengths.tolist() == [0]


def test_last_logits_only(runner):
    seq = tokens(8, seed=0)
    cache, _, _ = runner.prefill(seq[:4])
    logits, _ = runner.forward(cache, torch.tensor([seq[4:]]), commit=True, last_logits_only=True)
    assert logits.shape == (1, 1, VOCAB)
    assert_matches_full(runner, logits[0], seq)


def test_incremental_decoding_equals_full_forward(runner):
    seq = tokens(14, seed=1)
    cache, logits, _ = runner.prefill(seq[:5], all_logits=True)
    assert_matches_full(runner, logits, seq[:5])
    done = 5
    for chunk in (3, 1, 4, 1):
        logits, _ = runner.forward(cache, torch.tensor([seq[done : done + chunk]]), commit=True)
        done += chunk
        assert_matches_full(runner, logits[0], seq[:done])
    assert cache.lengths.tolist() == [done]


@pytest.mark.parametrize("kept", [0, 1, 2])
def test_rollback_then_reforward(runner, kept):
    prompt, draft, fresh = tokens(6, seed=2), tokens(3, seed=3), tokens(2, seed=4)
    cache, _, _ = runner.prefill(prompt)
    logits = step(runner, cache, [draft], keep=[kept])
    assert_matches_full(runner, logits[0], prompt + draft)
    assert cache.lengths.tolist() == [len(prompt) + kept]
    logits = step(runner, cache, [fresh])
    assert_matches_full(runner, logits[0], prompt + draft[:kept] + fresh)


def test_tree_mask_and_keeping_one_branch(runner):
    prompt = tokens(5, seed=5)
    r, a, b, c, d = tokens(5, seed=6)
    # Tree r -> {a -> c, b}: each node attends to its ancestors and itself.
    nodes = [r, a, b, c]
    parents = [None, 0, 0, 1]
    mask = torch.eye(4, dtype=torch.bool)
    for node, parent in enumerate(parents):
        while parent is not None:
            mask[node, parent] = True
            parent = parents[parent]
    depths = torch.tensor([[0, 1, 1, 2]])
    cache, _, _ = runner.prefill(prompt)
    logits, _ = runner.forward(cache, torch.tensor([nodes]), tree_mask=mask[None], depths=depths)
    for node, path in enumerate([[r], [r, a], [r, b], [r, a, c]]):
        assert_matches_full(runner, logits[0, node : node + 1], prompt + path)
    cache.commit(torch.tensor([[True, True, False, True]]))  # keep the branch r, a, c
    logits, _ = runner.forward(cache, torch.tensor([[d]]), commit=True)
    assert_matches_full(runner, logits[0], prompt + [r, a, c, d])


def test_ragged_batch_with_rollbacks(runner):
    prompts = [tokens(n, seed=10 + n) for n in (7, 3, 11)]
    contexts = [list(p) for p in prompts]
    cache = batch(runner, prompts)
    for keep in ([3, 1, 2], [1, 1, 1], [2, 3, 1]):
        new = [tokens(3, seed=20 + i + sum(keep)) for i in range(3)]
        new[1] = new[1][:2]  # a shorter row: its padding slot must never count
        keep = [min(k, len(n)) for k, n in zip(keep, new)]
        rows = [ctx[-1:] + n for ctx, n in zip(contexts, new)]  # the last token, as the engine feeds it
        logits = step(runner, cache, rows, keep=[k + 1 for k in keep])
        for i, (ctx, n, k) in enumerate(zip(contexts, new, keep)):
            assert_matches_full(runner, logits[i, : len(n) + 1], ctx + n)
            ctx.extend(n[:k] + [EMITTED])  # the kept drafts, then a token the cache has not seen yet
        assert cache.lengths.tolist() == [len(ctx) - 1 for ctx in contexts]


def test_keep_rows_and_compact(slot_runner):
    runner = slot_runner
    prompts = [tokens(n, seed=30 + n) for n in (4, 9, 6)]
    cache = batch(runner, prompts)
    # A three-token step keeping one token per row leaves two slots nobody uses.
    drafts = [p[-1:] + tokens(2, seed=40 + i) for i, p in enumerate(prompts)]
    step(runner, cache, drafts, keep=[1, 1, 1])
    cache.keep_rows([2, 0])
    assert cache.batch_size == 2
    assert bool(cache.valid.any(dim=0).all()), "keep_rows leaves no slot that no row uses"
    rows = [prompts[2] + [EMITTED], prompts[0] + [EMITTED]]
    logits = step(runner, cache, [r[-1:] + [7] for r in rows])
    for i, row in enumerate(rows):
        assert_matches_full(runner, logits[i], row + [7])
    cache.keep_rows([])
    assert cache.batch_size == 0 and cache.slots == 0


def test_compact_keeps_results_and_drops_dead_slots(slot_runner):
    runner = slot_runner
    prompt = tokens(4, seed=50)
    cache, _, _ = runner.prefill(prompt[:-1])
    context = list(prompt)
    for i in range(4):  # each step rejects three of four slots
        step(runner, cache, [context[-1:] + tokens(3, seed=60 + i)], keep=[1])
        context.append(EMITTED)
    # commit compacts once a quarter of the slots is dead; all kept slots must survive it.
    assert cache.slots < len(prompt) - 1 + 4 * 4
    assert int(cache.valid.sum()) == len(prompt) - 1 + 4
    logits = step(runner, cache, [context[-1:]])
    assert_matches_full(runner, logits[0], context)


@pytest.mark.parametrize("order", ["one-token-first", "one-token-last", "all-one-token"])
def test_append_with_one_token_prompts(runner, order):
    long, short = tokens(6, seed=70), tokens(1, seed=71)
    prompts = {"one-token-first": [short, long], "one-token-last": [long, short], "all-one-token": [short, short]}[order]
    cache = batch(runner, prompts)
    fresh = tokens(2, seed=72)
    logits = step(runner, cache, [p[-1:] + fresh for p in prompts])
    for i, prompt in enumerate(prompts):
        assert_matches_full(runner, logits[i], prompt + fresh)


def test_row_joining_a_batch_mid_decode(runner):
    first, second = tokens(5, seed=80), tokens(8, seed=81)
    cache = batch(runner, [first])
    step(runner, cache, [first[-1:] + [1, 2, 3]], keep=[2])
    first = first + [1, EMITTED]
    row, _, _ = runner.prefill(second[:-1])
    cache.append(row)
    logits = step(runner, cache, [first[-1:] + [4], second[-1:] + [5]])
    assert_matches_full(runner, logits[0], first + [4])
    assert_matches_full(runner, logits[1], second + [5])


def test_drop_last(runner):
    prompts = [tokens(5, seed=90), tokens(7, seed=91)]
    cache = batch(runner, prompts)
    extra = [tokens(3, seed=92), tokens(3, seed=93)]
    step(runner, cache, [p[-1:] + e for p, e in zip(prompts, extra)])
    cache.drop_last([2, 0])  # row 0 takes back its last two tokens
    contexts = [prompts[0] + extra[0][:1] + [EMITTED], prompts[1] + extra[1] + [EMITTED]]
    assert cache.lengths.tolist() == [len(c) - 1 for c in contexts]
    logits = step(runner, cache, [c[-1:] for c in contexts])
    for i, context in enumerate(contexts):
        assert_matches_full(runner, logits[i], context)


def test_drop_last_refuses_slots_that_are_not_valid(slot_runner):
    runner = slot_runner
    cache = batch(runner, [tokens(4, seed=95), tokens(4, seed=96)])
    step(runner, cache, [[1, 2], [3, 4]], keep=[2, 1])
    with pytest.raises(RuntimeError, match="row 1"):
        cache.drop_last([0, 1])


def test_hidden_states(runner):
    seq = tokens(9, seed=100)
    cache, _, _ = runner.prefill(seq[:6])
    _, hidden = runner.forward(cache, torch.tensor([seq[6:]]), hidden_states=True, commit=True)
    with torch.no_grad():
        full = runner.model(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
    assert len(hidden) == len(full) == runner.num_layers + 1
    for mine, theirs in zip(hidden, full):
        torch.testing.assert_close(mine[0], theirs[0, 6:], rtol=1e-5, atol=1e-5)


def test_keep_rows_repeats_and_reorders_rows(runner):
    prompts = [tokens(n, seed=120 + n) for n in (4, 9)]
    cache = batch(runner, prompts)
    cache.keep_rows([1, 0, 1])  # as the exactness tests copy one row into thousands
    rows = [prompts[1], prompts[0], prompts[1]]
    logits = step(runner, cache, [r[-1:] + [7] for r in rows])
    for i, row in enumerate(rows):
        assert_matches_full(runner, logits[i], row + [7])


def test_a_row_longer_than_the_capacity(runner):
    """The static cache grows past a block, keeping what it held; the slot cache just appends."""
    seq = tokens(BLOCK + 12, seed=130)
    cache, _, _ = runner.prefill(seq[: BLOCK - 2])
    logits, _ = runner.forward(cache, torch.tensor([seq[BLOCK - 2 :]]), commit=True)
    assert_matches_full(runner, logits[0], seq)
    assert cache.slots >= len(seq)


def test_batch_size_mismatch_is_refused(runner):
    cache = batch(runner, [tokens(3, seed=110), tokens(3, seed=111)])
    with pytest.raises(ValueError, match="batch of 1 rows against a cache of 2"):
        runner.forward(cache, torch.tensor([[1]]))
