"""The prefix cache is invisible: a prompt that begins with chunks an earlier prompt prefilled takes them from
the cache, and its keys, values, logits and text are those of a cold prefill, bit for bit, on both cache kinds
(the eager step's slot cache and the static step's), greedy and seeded, for every drafter, in a batch of
eight with rows joining mid-run; a perturbed block changes the text (the negative control). Eviction keeps the
budget, namespaces keep callers apart, and a prompt larger than the budget decodes uncached."""

from __future__ import annotations

import logging

import pytest
import torch

from specdec_core.build import build_engine
from specdec_core.config import Config
from specdec_core.control import Controller
from specdec_core.engine import Engine
from specdec_core.models.loading import eos_ids
from specdec_core.models.runner import ModelRunner
from specdec_core.models.static_runner import StaticRunner
from specdec_core.prefix_cache import Block, PrefixCache
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence

from .helpers import (
    decode,
    single_thread,  # noqa: F401  (autouse: torch on one thread)
)
from .test_engine import TINY_TEXTS
from .test_invisible import DRAFTERS, INT4, SETTINGS, STATIC_DRAFTERS, target  # noqa: F401  (fixture)

CHUNK = 8  # tokens a chunk: the tiny prompts span several
BLOCK = 3  # tokens a block where prefills are exact: not a divisor of the chunk, so blocks straddle chunks
CONTEXT = 64  # where prefills are exact, chunks shrink as their context grows: from 8 tokens to 2 over these prompts
SYSTEM = " ".join(TINY_TEXTS)  # the shared beginning of every conversation


@pytest.fixture(scope="module", params=["eager", "static"])
def runner(request, target) -> ModelRunner:  # noqa: F811  (the fixture imported above)
    return target if request.param == "eager" else StaticRunner.of(target)


def engine_of(runner: ModelRunner, drafter=None, budget: int | None = 2**30, chunk: int = CHUNK, exact: bool = False) -> Engine:
    """An engine whose prefills run in chunks of `chunk`, with a prefix cache of `budget` bytes (None: off); `exact`:
    prefills compute rows as decoding does, in chunks that shrink as their context grows, and the cache's blocks
    are BLOCK tokens (build_engine's choice where long passes stay on the kernel)."""
    cache = None
    if budget is not None:
        block = BLOCK if exact else chunk
        cache = PrefixCache(block, budget, block * runner.token_bytes(len(drafter.feature_layers) if drafter else 0))
    controller = Controller(gamma_max=4, fixed_gamma=3 if drafter else None)  # drafts every step: the test says something
    return Engine(runner, drafter, controller, eos_ids(runner), chunk_tokens=chunk, prefix_cache=cache, exact_prefill=exact,
                  chunk_context_tokens=CONTEXT if exact else None)


def conversations(runner: ModelRunner, setting: str, turn: int, earlier: list[Sequence] | None = None) -> list[Sequence]:
    """Eight rows over the shared beginning, each its own question; the second turn resends the first turn's
    prompt and answer and asks again, as a chat client does."""
    seqs = []
    for i, text in enumerate(TINY_TEXTS + TINY_TEXTS[:3]):
        prompt = runner.tokenizer.encode(f"{SYSTEM}\n{i}: {text}")
        if earlier:
            prompt = earlier[i].prompt_ids + earlier[i].output_ids + runner.tokenizer.encode(f"\nagain {i}:")
        seqs.append(Sequence(f"t{turn}-{i}", prompt, SamplingParams(**SETTINGS[setting], seed=100 + i), 12 - 2 * (i % 3)))
    return seqs


def chat(engine: Engine, runner: ModelRunner, setting: str) -> tuple[list[list[int]], list[Sequence], list[Sequence]]:
    """Two turns of eight conversations (half the rows joining after 2 steps); each turn's texts, then each
    turn's sequences."""
    first = conversations(runner, setting, 1)
    decode(engine, first[::2], {2: first[1::2]})
    second = conversations(runner, setting, 2, first)
    decode(engine, second[::2], {2: second[1::2]})
    return [seq.output_ids for seq in first + second], first, second


def test_a_cached_prefix_gives_the_cold_prefills_keys_values_and_logits_bit_for_bit(runner):
    prompt = runner.tokenizer.encode(SYSTEM)
    assert len(prompt) > 3 * CHUNK
    warm = engine_of(runner)
    warm.add(Sequence("first", prompt[: 3 * CHUNK + 3], SamplingParams(temperature=0), 1))
    longer = prompt + [5, 6, 7]
    cold_engine = engine_of(runner, budget=None)
    hit, cold = warm.begin(Sequence("hit", longer, SamplingParams(), 1)), cold_engine.begin(Sequence("cold", longer, SamplingParams(), 1))
    for admission, engine in ((hit, warm), (cold, cold_engine)):
        while not engine.advance(admission):
            pass
    assert hit.cached == 3 * CHUNK and cold.cached == 0
    assert torch.equal(hit.logits[-1], cold.logits[-1])
    assert all(torch.equal(a, b) for a, b in zip(hit.row.read_span(0, len(longer) - 1), cold.row.read_span(0, len(longer) - 1)))


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("drafter", [None, "suffix", "draft-model", "eagle", "eagle3", "layer-skip"])
def test_text_is_the_same_with_the_cache_on_and_off(runner, drafter, setting):
    if drafter == "layer-skip" and isinstance(runner, StaticRunner):
        pytest.skip("layer-skip drafts in the eager step's slot cache")
    make = DRAFTERS[drafter] if drafter else (lambda target: None)
    on = engine_of(runner, make(runner))
    texts, first, second = chat(on, runner, setting)
    assert texts == chat(engine_of(runner, make(runner), budget=None), runner, setting)[0]
    # A second turn finds every whole chunk its first turn prefilled (its whole prompt).
    assert [seq.cached_tokens for seq in second] == [len(seq.prompt_ids) // CHUNK * CHUNK for seq in first]
    assert drafter is None or sum(seq.stats.draft_tokens for seq in second) > 0


def test_an_exact_prefill_computes_the_keys_and_values_decoding_wrote(runner):
    """Where prefills are exact (row-invariant), a cold prefill of a decoded sequence's prompt and answer gives
    every position the keys and values its decoding wrote (verify passes of a drafter included), bit for bit;
    the control: a prefill on SDPA does not."""
    engine = engine_of(runner, DRAFTERS["suffix"](runner), budget=None, exact=True)
    seq = Sequence("decoded", runner.tokenizer.encode(SYSTEM), SamplingParams(temperature=0), 20)
    engine.add(seq)
    while True:  # the row's keys and values as of the step before it finished (and left the batch)
        engine.step()
        if seq.finished:
            break
        decoded = engine.cache.read_span(0, int(engine.cache.lengths[0]))
    committed = decoded[0].shape[2]
    assert committed > len(seq.prompt_ids)
    for exact, equal in ((True, True), (False, False)):
        cold = engine_of(runner, budget=None, exact=exact)
        admission = cold.begin(Sequence("cold", seq.tokens[: committed + 1], SamplingParams(), 1))
        while not cold.advance(admission):
            pass
        prefilled = admission.row.read_span(0, committed)
        assert all(torch.equal(a, b) for a, b in zip(prefilled, decoded)) == equal


def test_exact_prefill_chunks_shrink_as_the_context_they_attend_grows(runner):
    """Where prefills are exact, a chunk holds fewer tokens the more positions its rows attend: none does more
    work than the first (rows times linear layers and attention, in units of one row's linear layers, with a
    row's attention over CONTEXT positions costing as much as them), and together they prefill the prompt."""
    engine = engine_of(runner, budget=None, exact=True)
    admission = engine.begin(Sequence("long", runner.tokenizer.encode(SYSTEM), SamplingParams(), 1))
    ends = [0]
    while not engine.advance(admission):
        ends.append(admission.done)
    ends.append(admission.done)
    chunks = [(start, end - start) for start, end in zip(ends, ends[1:]) if end > start]
    sizes = [size for _, size in chunks]
    assert sum(sizes) == len(admission.ids)
    assert sizes[0] == CHUNK and sizes == sorted(sizes, reverse=True) and sizes[-2] < CHUNK // 2

    def work(rows: int, start: int) -> float:
        return rows * (1 + (start + rows / 2) / CONTEXT)

    assert all(work(size, start) <= work(CHUNK, 0) < work(size + 1, start) for start, size in chunks[:-1])


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("drafter", [None, "suffix", "draft-model", "eagle", "eagle3", "layer-skip"])
def test_with_exact_prefills_answers_are_cached_and_text_is_the_same_with_the_cache_on_and_off(runner, drafter, setting):
    """A second turn takes every whole block of its first turn's prompt and answer from the cache (blocks of
    BLOCK tokens, straddling chunks), and its text is the cache-off text; a drafter that reads the target's
    features gets the prompt's blocks only (no features are kept for an answer)."""
    if drafter == "layer-skip" and isinstance(runner, StaticRunner):
        pytest.skip("layer-skip drafts in the eager step's slot cache")
    make = DRAFTERS[drafter] if drafter else (lambda target: None)
    on = engine_of(runner, make(runner), exact=True)
    texts, first, second = chat(on, runner, setting)
    assert texts == chat(engine_of(runner, make(runner), budget=None, exact=True), runner, setting)[0]
    answered = drafter not in ("eagle", "eagle3")
    expected = [((len(seq.tokens) - 1) if answered else len(seq.prompt_ids)) // BLOCK * BLOCK for seq in first]
    assert [seq.cached_tokens for seq in second] == expected
    assert answered == all(cached > len(seq.prompt_ids) for cached, seq in zip(expected, first))


def test_the_draft_models_own_keys_and_values_are_kept_with_the_blocks(runner, monkeypatch):
    """A draft model's prefill of a second turn takes its own keys and values of the chunks the first turn
    prefilled from their blocks, and passes only the rest on the draft model."""
    drafter = DRAFTERS["draft-model"](runner)
    passes = []  # the widths of the draft model's prefill passes (a fresh row's, not the batch's)
    forward = drafter.runner.forward

    def recording(cache, input_ids, *args, **kwargs):
        if cache is not drafter.cache:
            passes.append(input_ids.shape[1])
        return forward(cache, input_ids, *args, **kwargs)

    monkeypatch.setattr(drafter.runner, "forward", recording)
    engine = engine_of(runner, drafter)
    texts, first, second = chat(engine, runner, "greedy")
    assert all(block.own is not None for block in engine.prefix_cache.blocks.values())
    assert sum(passes) == sum(len(seq.prompt_ids) - seq.cached_tokens for seq in first + second)
    assert max(passes) <= CHUNK  # in passes of a chunk at most (the next test: with steps between)
    assert all(seq.cached_tokens > 0 for seq in second) and sum(seq.stats.accepted_tokens for seq in second) > 0
    assert texts == chat(engine_of(runner, budget=None), runner, "greedy")[0]


def test_a_draft_models_prefill_runs_a_pass_a_round_with_the_running_rows_steps_between(runner, monkeypatch):
    """Counted in passes, not time: a long prompt joining a running batch is prefilled on the draft model too in
    passes of a chunk, one a round beside the target's chunk, so a running row steps between any two."""
    drafter = DRAFTERS["draft-model"](runner)
    events = []
    forward = drafter.runner.forward

    def recording(cache, input_ids, *args, **kwargs):
        events.append("draft prefill" if cache is not drafter.cache else "draft step")
        return forward(cache, input_ids, *args, **kwargs)

    monkeypatch.setattr(drafter.runner, "forward", recording)
    engine = engine_of(runner, drafter, budget=None)
    no_eos = {token: -100.0 for token in eos_ids(runner)}
    engine.add(Sequence("running", runner.tokenizer.encode("x"), SamplingParams(temperature=0, logit_bias=no_eos), 400))
    prompt = runner.tokenizer.encode(SYSTEM)
    admission = engine.begin(Sequence("long", prompt, SamplingParams(temperature=0), 2))
    events.clear()
    rounds = 0
    while not engine.advance(admission):
        engine.step()
        events.append("step")
        rounds += 1
    prefills = [i for i, event in enumerate(events) if event == "draft prefill"]
    assert len(prefills) == -(-len(prompt) // CHUNK)
    assert all("step" in events[a:b] for a, b in zip(prefills, prefills[1:]))
    assert rounds >= len(prefills)


def test_a_drafters_own_part_stays_within_the_budget():
    keys = torch.zeros(2, 1, CHUNK, 4)
    block_bytes = 2 * keys.nelement() * keys.element_size()
    cache = PrefixCache(CHUNK, 2 * block_bytes + block_bytes // 2, block_bytes)
    snapshot = cache.snapshot()
    for key in (b"a", b"b"):
        cache.insert(key, Block(keys.clone(), keys.clone(), None))
    cache.attach_own(b"a", (keys.clone(), keys.clone()))  # a's own part takes the room of b, not a's own
    assert list(cache.blocks) == [b"a"] and cache.bytes == 2 * block_bytes and cache.counts.evicted_blocks == 1
    cache.insert(b"c", Block(keys.clone(), keys.clone(), None))
    cache.attach_own(b"c", (torch.zeros(2, 1, 3 * CHUNK, 4), keys.clone()))  # more than the whole budget: not kept
    assert list(cache.blocks) == [b"c"] and cache.blocks[b"c"].own is None and cache.bytes == block_bytes
    cache.restore(snapshot)
    assert not cache.blocks and cache.bytes == 0


def test_negative_control_a_perturbed_block_changes_the_text(runner):
    on = engine_of(runner)
    first = conversations(runner, "greedy", 1)
    decode(on, first)
    for block in on.prefix_cache.blocks.values():
        block.keys.copy_(torch.randn_like(block.keys))
        block.values.copy_(torch.randn_like(block.values))
    with_perturbed = conversations(runner, "greedy", 2, first)
    decode(on, with_perturbed)
    cold = conversations(runner, "greedy", 2, first)
    decode(engine_of(runner, budget=None), cold)
    assert [s.output_ids for s in with_perturbed] != [s.output_ids for s in cold]


def test_eviction_keeps_the_budget_and_every_request_completes_with_its_uncached_text(target):  # noqa: F811
    # Room for one conversation's blocks and a few more: eight conversations of two turns overflow it.
    blocks = len(conversations(target, "greedy", 1)[0].prompt_ids) // CHUNK + 4
    block = CHUNK * target.token_bytes(0)
    small = engine_of(target, budget=blocks * block)
    texts, *_ = chat(small, target, "greedy")
    cache = small.prefix_cache
    assert cache.bytes <= blocks * block and len(cache.blocks) <= blocks and cache.counts.evicted_blocks > 0
    assert cache.counts.hit_tokens > 0
    assert texts == chat(engine_of(target, budget=None), target, "greedy")[0]


def test_prompts_admitted_together_share_their_chunks(target):  # noqa: F811
    """A request's n choices, or two requests over one system prompt, are admitted together and prefilled one
    after the other: the second looks the cache up at its first chunk, after the first's chunks are in."""
    engine = engine_of(target)
    prompt = target.tokenizer.encode(SYSTEM)
    first, second = (engine.begin(Sequence(name, prompt, SamplingParams(temperature=0), 1)) for name in "ab")
    while not engine.advance(first):
        pass
    engine.advance(second)
    assert first.cached == 0 and second.cached == (len(prompt) - 1) // CHUNK * CHUNK


def test_namespaces_do_not_share_blocks(target):  # noqa: F811
    engine = engine_of(target)
    prompt = target.tokenizer.encode(SYSTEM)
    for namespace, expected in (("key-a", 0), ("key-b", 0), ("key-a", len(prompt) - 1 - (len(prompt) - 1) % CHUNK)):
        seq = Sequence(namespace, prompt, SamplingParams(temperature=0), 1, cache_namespace=namespace)
        engine.add(seq)
        assert seq.cached_tokens == expected
        engine.remove([seq])


def test_a_prompt_larger_than_the_budget_decodes_uncached_and_says_so_once(target, caplog):  # noqa: F811
    engine = engine_of(target, budget=2 * CHUNK * target.token_bytes(0))
    prompt = target.tokenizer.encode(SYSTEM)
    with caplog.at_level(logging.WARNING, logger="specdec"):
        for i in range(2):
            seq = Sequence(f"long{i}", prompt, SamplingParams(temperature=0), 2)
            decode(engine, [seq])
            assert seq.cached_tokens == 0 and len(seq.output_ids) == 2
    assert not engine.prefix_cache.blocks
    assert sum("more than prefill.cache_bytes" in r.message for r in caplog.records) == 1


def test_a_budget_below_one_block_is_a_config_error_naming_the_minimum():
    config = Config.model_validate({"model": INT4.model_dump(), "speculation": {"drafter": "none"},
                                    "prefill": {"chunk_tokens": 16, "cache_block_tokens": 16, "cache_bytes": 100}})
    with pytest.raises(ValueError, match=r"holds no block: one block of 16 tokens takes \d+ bytes"):
        build_engine(config)
