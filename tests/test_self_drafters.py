"""Layer skip, early exit, the quantized copy, the reduced vocabulary and the hybrid drafter.

Each is exact: its speculative sampling passes the chi-square test of
test_exactness.py against the target's exact distribution, and its greedy
decoding equals plain greedy decoding (tiny models and SmolLM2-135M in fp32).
Layer skip drafts from the target's own cache: it allocates no cache of its
own and leaves the target's cache as a fresh prefill would make it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from specdec_core.build import build_drafter
from specdec_core.config import (
    DRAFTERS,
    Config,
    ModelConfig,
    SpeculationConfig,
    with_overrides,
)
from specdec_core.control import Controller
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.drafters.hybrid import HybridDrafter
from specdec_core.drafters.layer_skip import LayerSkipDrafter
from specdec_core.drafters.ngram import NgramDrafter, lookup
from specdec_core.drafters.quantized import quantized_copy
from specdec_core.drafters.registry import NO_DRAFTER, REGISTRY, factory
from specdec_core.drafters.suffix import SuffixDrafter
from specdec_core.engine import Engine
from specdec_core.models.loading import eos_ids, load_runner
from specdec_core.models.quant import QuantLinear
from specdec_core.models.runner import BatchCache, ModelRunner
from specdec_core.models.vocab import (
    COUNTS_FILE,
    ReducedVocab,
    count_tokens,
    reduced_vocab,
)
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence
from specdec_tools.calibrate import layer_acceptance

from .helpers import (
    decode,
    full_logits,
    greedy_reference,
    single_thread,  # noqa: F401  (autouse: torch on one thread)
    tiny_runner,
)
from .test_engine import (  # noqa: F401  (fixtures: greedy references, 32 tokens)
    assert_rows_match,
    run_rows,
    smol_prompts,
    smol_references,
    smollm2,
)
from .test_exactness import ALPHA, PARAMS, ROWS, VOCAB, exact, generate, pvalues


@pytest.fixture(scope="module")
def target() -> ModelRunner:
    return tiny_runner(seed=0, vocab=VOCAB)


# Tokens 0..7 of 12: the target often draws one the draft cannot propose.
SMALL = ReducedVocab(torch.arange(8), VOCAB)


def int4_copy(target: ModelRunner, vocab: ReducedVocab | None = None) -> ModelRunner:
    return quantized_copy(target, "int4", vocab, cache_dir=None)


# name -> (drafter factory, prompt). The hybrid's prompt ends in a 2-gram seen before, so its first
# step takes the n-gram proposal and later steps mix n-gram rows and layer-skip rows.
DISTRIBUTION_DRAFTERS = {
    "layer-skip": (lambda t: LayerSkipDrafter(t, 1), [1, 2, 3, 4, 5]),
    "layer-skip-vocab-exit": (lambda t: LayerSkipDrafter(t, 1, SMALL, early_exit=0.3), [1, 2, 3, 4, 5]),
    "quantized-int4-vocab-exit": (
        lambda t: DraftModelDrafter(int4_copy(t, SMALL), VOCAB, SMALL, early_exit=0.3), [1, 2, 3, 4, 5]
    ),
    "hybrid": (lambda t: HybridDrafter(NgramDrafter(2, 3), LayerSkipDrafter(t, 1)), [8, 7, 9, 8, 7]),
    # Suffix trees and layer-skip chains in one batch: the chains join as trees of one branch.
    "hybrid-suffix": (
        lambda t: HybridDrafter(SuffixDrafter(1000, factor=2.0, min_probability=0.0), LayerSkipDrafter(t, 1)),
        [8, 7, 9, 8, 7],
    ),
}
DISTRIBUTION_CASES = (
    [("layer-skip", p, "gumbel") for p in PARAMS] + [(d, "t1", "gumbel") for d in list(DISTRIBUTION_DRAFTERS)[1:]]
    + [(d, "t1", "rejection") for d in ("layer-skip", "hybrid", "hybrid-suffix")]
)


@pytest.mark.parametrize("drafter, setting, rule", DISTRIBUTION_CASES)
def test_speculative_sampling_is_distributed_as_the_target(target, drafter, setting, rule):
    make, prompt = DISTRIBUTION_DRAFTERS[drafter]
    tokens, seqs = generate(target, make(target), prompt, PARAMS[setting], ROWS, rule)
    drafted = sum(seq.stats.draft_tokens for seq in seqs)
    accepted = sum(seq.stats.accepted_tokens for seq in seqs)
    # Both branches of the rule ran many times: drafts kept, and drafts rejected and replaced.
    assert 0.1 * drafted < accepted < 0.9 * drafted, (drafted, accepted)
    if "vocab" in drafter:  # the target drew tokens the draft cannot propose
        assert (tokens >= SMALL.size).mean() > 0.01
    if "exit" in drafter:  # without early exit every row drafts 2 tokens in its first step (3 to go, gamma 3)
        assert sum(seq.stats.draft_tokens < 2 for seq in seqs) > ROWS // 100
    result = pvalues(tokens, exact(target, prompt, PARAMS[setting]))
    assert min(result.values()) > ALPHA, result


# -- greedy equality on tiny models -------------------------------------------

TINY_TOKENS = 24
TINY_PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7], [3, 3, 3], [11, 10, 11, 10, 11]]


@pytest.fixture(scope="module")
def tiny_references(target) -> list[list[int]]:
    engine = Engine(target, None, Controller(), set())
    seqs = [Sequence(f"plain{i}", p, SamplingParams(temperature=0), TINY_TOKENS) for i, p in enumerate(TINY_PROMPTS * 2)]
    decode(engine, seqs)
    return [seq.output_ids for seq in seqs]


GREEDY_DRAFTERS = {
    "layer-skip": lambda t: LayerSkipDrafter(t, 1),
    "layer-skip-vocab-exit": lambda t: LayerSkipDrafter(t, 1, SMALL, early_exit=0.5),
    "quantized-int8": lambda t: DraftModelDrafter(quantized_copy(t, "int8", None, None), VOCAB),
    "quantized-int4-vocab": lambda t: DraftModelDrafter(int4_copy(t, SMALL), VOCAB, SMALL, early_exit=0.5),
    "hybrid-layer-skip": lambda t: HybridDrafter(NgramDrafter(2, 3), LayerSkipDrafter(t, 1)),
    "hybrid-quantized": lambda t: HybridDrafter(NgramDrafter(2, 3), DraftModelDrafter(int4_copy(t), VOCAB)),
}


@pytest.mark.parametrize("gamma", [None, 3], ids=["controller", "fixed-gamma"])
@pytest.mark.parametrize("drafter", GREEDY_DRAFTERS)
def test_tiny_greedy_equals_plain(target, tiny_references, drafter, gamma):
    """Rows of a ragged batch, joining mid-decode and finishing early, each equal plain greedy decoding."""
    engine = Engine(target, GREEDY_DRAFTERS[drafter](target), Controller(fixed_gamma=gamma), set())
    seqs, _ = run_rows(engine, TINY_PROMPTS * 2, TINY_TOKENS, temperature=0)
    assert_rows_match(seqs, tiny_references)
    if gamma:
        assert sum(seq.stats.draft_tokens for seq in seqs) > 0


# -- layer skip shares the target's cache --------------------------------------


def kv_snapshot(cache: BatchCache) -> list[torch.Tensor]:
    return [t.clone() for layer in cache.kv.layers if layer.is_initialized for t in (layer.keys, layer.values)]


def test_layer_skip_allocates_no_cache_and_rolls_back_exactly(target, monkeypatch):
    drafter = LayerSkipDrafter(target, 1)
    engine = Engine(target, drafter, Controller(fixed_gamma=4), set())
    seqs = [Sequence(f"r{i}", p, SamplingParams(temperature=1.0, seed=i), 40) for i, p in enumerate(TINY_PROMPTS)]
    for seq in seqs:
        engine.add(seq)
    # The drafter holds the engine's cache object itself, and no cache of its own.
    assert drafter.cache is engine.cache
    assert not [v for k, v in vars(drafter).items() if isinstance(v, (BatchCache, DynamicCache)) and v is not engine.cache]
    created = []
    monkeypatch.setattr(DynamicCache, "__init__", lambda self, *a, **kw: created.append(self))
    rejected = 0
    for _ in range(6):
        before = kv_snapshot(engine.cache)
        proposal = drafter.propose(engine.seqs, 4)
        assert proposal.width == 4
        # Proposing leaves the target's cache exactly as it was: same slots, same keys and values.
        after = kv_snapshot(engine.cache)
        assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
        rejected += sum(row.accepted < row.drafted for row in engine.step().rows)
    assert not created, "drafting or verifying allocated a cache"
    monkeypatch.undo()
    assert rejected > 0, "the test needs rejections to exercise rollback"

    # The rolled-back cache answers as a fresh prefill of the same tokens would: target and draft alike.
    fresh = BatchCache.empty(target.device)
    for seq in seqs:
        fresh.append(target.prefill(seq.tokens[:-1])[0])
    draft_now = drafter._first_logits(seqs)
    engine.cache.drop_pending()
    drafter.attach(fresh)
    draft_fresh = drafter._first_logits(seqs)
    torch.testing.assert_close(draft_now, draft_fresh, rtol=1e-5, atol=1e-5)
    last = torch.tensor([[seq.tokens[-1]] for seq in seqs])
    logits, _ = target.forward(engine.cache, last)
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(logits[i, 0], full_logits(target, seq.tokens)[-1], rtol=1e-5, atol=1e-5)


def test_layer_skip_with_every_layer_is_the_target(target):
    """k = L drafts exactly what the target would: greedy drafts are all kept (fp32)."""
    engine = Engine(target, LayerSkipDrafter(target, target.num_layers), Controller(fixed_gamma=4), set())
    seqs = [Sequence(f"r{i}", p, SamplingParams(temperature=0), 16) for i, p in enumerate(TINY_PROMPTS)]
    decode(engine, seqs)
    assert all(seq.stats.accepted_tokens == seq.stats.draft_tokens > 0 for seq in seqs)


# -- early exit, the reduced vocabulary, the hybrid, the quantized copy ---------


@pytest.mark.parametrize("threshold, width", [(0.0, 4), (1.0, 0)])
def test_early_exit_stops_drafting_under_the_threshold(target, threshold, width):
    drafter = LayerSkipDrafter(target, 1, early_exit=threshold)
    engine = Engine(target, drafter, Controller(), set())
    seqs = [Sequence(f"r{i}", p, SamplingParams(temperature=0.7), 8) for i, p in enumerate(TINY_PROMPTS)]
    for seq in seqs:
        engine.add(seq)
    proposal = drafter.propose(seqs, 4)
    assert proposal.lengths == [width] * len(seqs) and proposal.width == width


def test_reduced_vocabulary_keeps_q_inside_the_set(target):
    drafter = LayerSkipDrafter(target, 1, SMALL)
    engine = Engine(target, drafter, Controller(), set())
    seqs = [Sequence(f"r{i}", p, SamplingParams(temperature=1.0, seed=i), 8) for i, p in enumerate(TINY_PROMPTS)]
    for seq in seqs:
        engine.add(seq)
    proposal = drafter.propose(seqs, 3)
    assert proposal.probs[..., 8:].sum() == 0 and (proposal.tokens < 8).all()
    torch.testing.assert_close(proposal.probs.sum(-1), torch.ones(len(seqs), 3))


def test_most_frequent_keeps_special_tokens_and_breaks_ties_by_id():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 7])
    vocab = ReducedVocab.most_frequent(counts, 4, always={5})
    assert vocab.ids.tolist() == [2, 3, 5, 6] and vocab.full_size == 7
    logits = vocab.expand(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    assert logits[0, [2, 3, 5, 6]].tolist() == [1.0, 2.0, 3.0, 4.0] and logits[0, [0, 1, 4]].isinf().all()


def test_count_tokens_counts_the_tokenizer_s_ids():
    from specdec_core.models.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    text = "def decode(self, s):\n    return s\n"
    counts = count_tokens(tokenizer, iter([text, text]), len(tokenizer))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert counts.sum() == 2 * len(ids) and all(counts[i] >= 2 for i in ids)


def test_hybrid_chooses_per_row(target):
    drafter = HybridDrafter(NgramDrafter(2, 3), LayerSkipDrafter(target, 1))
    engine = Engine(target, drafter, Controller(), set())
    # The bias makes the first token, drawn as the row joins, a 9: the row's tokens repeat 8, 7, 9.
    repeats = SamplingParams(temperature=0, logit_bias={9: 100.0})
    seqs = [Sequence("repeats", [8, 7, 9, 8, 7], repeats, 8), Sequence("new", [1, 2, 3], SamplingParams(temperature=0), 8)]
    for seq in seqs:
        engine.add(seq)
    proposal = drafter.propose(seqs, 3)
    assert proposal.tokens[0, : proposal.lengths[0]].tolist() == lookup(seqs[0].tokens, 2, 3, 3)[0] == [8, 7, 9]
    assert proposal.lengths[1] == 3 and proposal.probs[1].sum(-1).tolist() == [1.0] * 3  # greedy q: one-hot
    assert drafter._model_rows == [False, True]


def test_quantized_copy_shares_the_target_s_tensors_and_leaves_it_float(target):
    runner = quantized_copy(target, "int8", None, None)
    assert runner.model.get_input_embeddings().weight is target.model.get_input_embeddings().weight
    assert not any(isinstance(m, QuantLinear) for m in target.model.modules())
    assert any(isinstance(m, QuantLinear) for m in runner.model.modules())


TINY_CONFIG = ModelConfig(target="tiny-random-llama", dtype="fp32", device="cpu")


@pytest.mark.parametrize(
    "speculation, kind, inner",
    [
        (SpeculationConfig(drafter="layer-skip"), LayerSkipDrafter, None),
        (SpeculationConfig(drafter="quantized", quantized={"weights": "int8"}), DraftModelDrafter, None),
        (SpeculationConfig(drafter="hybrid"), HybridDrafter, LayerSkipDrafter),
        (SpeculationConfig(drafter="hybrid", hybrid={"drafter": "quantized"}), HybridDrafter, DraftModelDrafter),
        (SpeculationConfig(drafter="hybrid", hybrid={"lookup": "suffix", "min_n": 3}), HybridDrafter, LayerSkipDrafter),
    ],
)
def test_config_builds_each_drafter(speculation, kind, inner):
    config = Config(model=TINY_CONFIG, speculation=speculation)
    drafter = build_drafter(config, load_runner(TINY_CONFIG.target, TINY_CONFIG))
    assert isinstance(drafter, kind) and drafter.name == speculation.drafter
    if inner:
        assert isinstance(drafter.model, inner) and drafter.model.name == speculation.hybrid.drafter
        lookup = drafter.lookup
        assert isinstance(lookup, SuffixDrafter if speculation.hybrid.lookup == "suffix" else NgramDrafter)
        assert (lookup.min_match if isinstance(lookup, SuffixDrafter) else lookup.min_n) == speculation.hybrid.min_n
    if kind is LayerSkipDrafter:
        assert drafter.k == 1  # 3/4 of the tiny model's two layers


def test_each_registered_name_has_a_factory_and_an_unknown_name_lists_them():
    assert DRAFTERS == (NO_DRAFTER, *REGISTRY)
    assert all(callable(factory(name)) for name in REGISTRY)
    with pytest.raises(ValueError, match=f"unknown drafter 'nope'; choose one of {', '.join(DRAFTERS)}"):
        factory("nope")


def test_the_drafter_names_come_without_torch():
    # The registry imports a drafter's module only to build it: the config and the CLI's parsers read names only.
    code = ("import argparse, sys; import specdec_core.config; from specdec_tools.bench.cli import add_arguments; "
            "add_arguments(argparse.ArgumentParser()); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


# -- SmolLM2-135M in float32 ----------------------------------------------------

SMOL_TOKENS = 24
SMOL_PROMPTS = 12  # of the fixture's 21
SMOL_VOCAB = 8192


@pytest.fixture(scope="module")
def smol_vocab(smollm2, smollm2_dir) -> ReducedVocab:
    vocab = reduced_vocab(smollm2.tokenizer, smollm2.vocab_size, SMOL_VOCAB, smollm2_dir)
    assert (smollm2_dir / COUNTS_FILE).is_file() and vocab.size == SMOL_VOCAB
    assert set(smollm2.tokenizer.all_special_ids) <= set(vocab.ids.tolist())
    return vocab


# name -> (drafter factory, prompts). The int8 kernel is slow in fp32 (several times a float pass per row), so
# the quantized drafter decodes fewer rows; the tiny models cover its batching.
SMOL_DRAFTERS = {
    "layer-skip-vocab-exit": (lambda t, v: LayerSkipDrafter(t, 20, v, early_exit=0.2), SMOL_PROMPTS),
    "hybrid-layer-skip": (lambda t, v: HybridDrafter(NgramDrafter(2, 3), LayerSkipDrafter(t, 24)), SMOL_PROMPTS),
    "quantized-int8-vocab": (lambda t, v: DraftModelDrafter(quantized_copy(t, "int8", v, None), t.vocab_size, v), 3),
}


@pytest.mark.real_model
@pytest.mark.parametrize("drafter", SMOL_DRAFTERS)
def test_smollm2_speculative_greedy_equals_plain(smollm2, smol_prompts, smol_references, smol_vocab, drafter):
    make, rows = SMOL_DRAFTERS[drafter]
    engine = Engine(smollm2, make(smollm2, smol_vocab), Controller(fixed_gamma=4), eos_ids(smollm2))
    seqs, _ = run_rows(engine, smol_prompts[:rows], SMOL_TOKENS, temperature=0)
    assert_rows_match(seqs, smol_references[:rows])
    assert sum(seq.stats.accepted_tokens for seq in seqs) > 0


# -- calibration ------------------------------------------------------------------


def test_overrides_name_a_drafter_and_its_settings():
    config = with_overrides(Config(model=TINY_CONFIG), "layer-skip:layer_skip.k=3:vocab_size=200:gamma=2")
    spec = config.speculation
    assert (spec.drafter, spec.layer_skip.k, spec.vocab_size, spec.gamma) == ("layer-skip", 3, 200, 2)
    for bad in ("layer-skip:layer_skip.kk=3", "layer-skip:no_such.k=3", "layer-skip:gamma", "layer-skip:gamma="):
        with pytest.raises(ValueError, match="key of the speculation section"):
            with_overrides(Config(model=TINY_CONFIG), bad)


def test_layer_acceptance_of_all_layers_is_one(target):
    prompt = TINY_PROMPTS[0]
    output = greedy_reference(target, prompt, 8)
    rates = layer_acceptance(LayerSkipDrafter(target, 1), prompt, output, temperature=0.0)
    assert rates.shape == (target.num_layers,) and rates[-1] == 1.0
    assert float(layer_acceptance(LayerSkipDrafter(target, 1), prompt, output, temperature=1.0)[-1]) == pytest.approx(1.0)
