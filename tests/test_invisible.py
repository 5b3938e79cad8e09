"""Speculation is invisible: over a quantized target (int4 weights, bf16 activations, so its passes are
row-invariant), every drafter returns plain decoding's text token for token, greedy and seeded at 0.7, for
rows that join mid-run, and a request returns the same text alone as in a batch of others; on the compiled
static step too."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from specdec_core.config import Config, ModelConfig
from specdec_core.control import Controller
from specdec_core.drafters.base import Drafter
from specdec_core.drafters.distilled import DistilledDrafter
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.drafters.eagle import EagleDrafter
from specdec_core.drafters.hybrid import HybridDrafter
from specdec_core.drafters.layer_skip import LayerSkipDrafter
from specdec_core.drafters.medusa import MedusaDrafter
from specdec_core.drafters.ngram import NgramDrafter
from specdec_core.drafters.suffix import SuffixDrafter
from specdec_core.engine import Engine
from specdec_core.models import attention
from specdec_core.models.eagle3_net import Eagle3Net
from specdec_core.models.eagle_net import EagleNet
from specdec_core.models.loading import eos_ids, load_runner
from specdec_core.models.runner import ModelRunner
from specdec_core.models.quant import quantize_linears
from specdec_core.models.static_runner import StaticRunner
from specdec_core.models.vocab import ReducedVocab
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence
from specdec_tools.bench.prompts import load_prompts
from specdec_tools.flips import flips

from .helpers import (
    decode,
    single_thread,  # noqa: F401  (autouse: torch on one thread)
)
from .test_distill import random_adapter
from .test_engine import TINY_TEXTS
from .test_medusa import perturbed_heads

INT4 = ModelConfig(target="tiny-random-qwen2", dtype="bf16", weights="int4", device="cpu")
MAX_TOKENS = 20
SETTINGS = {"greedy": {"temperature": 0.0}, "seeded-0.7": {"temperature": 0.7, "top_p": 0.95}}


@pytest.fixture(scope="module")
def target() -> ModelRunner:
    """The int4 tiny model in bf16, as the default config serves: its rounding is coarse enough that any
    difference of numerics between a verify pass and one-token steps flips near-ties (fp32's rarely does)."""
    runner = load_runner(INT4.target, INT4)
    assert runner.row_invariant
    return runner


def float_copy() -> ModelRunner:
    """The target's own float weights: a draft that agrees with the int4 target often, not always."""
    return load_runner(INT4.target, INT4.model_copy(update={"weights": "bf16"}))


def untrained_eagle3(model: torch.nn.Module) -> Eagle3Net:
    """EAGLE-3's drafter as the server runs it (bf16, int4 linear layers), untrained, over half the vocabulary."""
    torch.manual_seed(0)
    size = model.config.vocab_size
    net = Eagle3Net(model, ReducedVocab.most_frequent(torch.randperm(size).float(), size // 2, set()))
    net = net.to(torch.bfloat16).eval().requires_grad_(False)
    quantize_linears(net, "int4")
    return net


DRAFTERS: dict[str, Callable[[ModelRunner], Drafter]] = {
    "ngram": lambda target: NgramDrafter(),
    "ngram-tree": lambda target: NgramDrafter(candidates=4),
    "suffix": lambda target: SuffixDrafter(max_tokens=10_000, factor=2.0, min_probability=0.0),
    "draft-model": lambda target: DraftModelDrafter(float_copy(), target.vocab_size),
    "layer-skip": lambda target: LayerSkipDrafter(target, k=1),
    "hybrid": lambda target: HybridDrafter(NgramDrafter(), DraftModelDrafter(float_copy(), target.vocab_size)),
    "hybrid-suffix": lambda target: HybridDrafter(SuffixDrafter(10_000, factor=2.0, min_probability=0.0),
                                                  DraftModelDrafter(float_copy(), target.vocab_size)),
    "eagle": lambda target: EagleDrafter(EagleNet(float_copy().model).eval().requires_grad_(False), 4, 3, 8),
    "eagle3": lambda target: EagleDrafter(untrained_eagle3(float_copy().model), 1, 3, 3),
    "hybrid-eagle3": lambda target: HybridDrafter(SuffixDrafter(10_000, factor=2.0, min_probability=0.0),
                                                  EagleDrafter(untrained_eagle3(float_copy().model), 1, 3, 3)),
    "medusa": lambda target: MedusaDrafter(target, perturbed_heads(target.config.hidden_size, 3, 0.02, seed=0), None, 6, 2),
    "distilled": lambda target: DistilledDrafter(target, random_adapter(target.config.hidden_size, 0.02, seed=0), k=1),
}
# Not here: `quantized` drafts with an int8/int4 copy of a float target, and over this target would be the target.
LOOKUP_DRAFTERS = ("ngram", "ngram-tree", "suffix")  # propose nothing where no text repeats


def prompts_of(target: ModelRunner) -> list[list[int]]:
    return [target.tokenizer.encode(text) for text in TINY_TEXTS]


def sequences(target: ModelRunner, setting: str, copies: int = 2) -> list[Sequence]:
    """Each prompt `copies` times, each row its own seed; budgets differ so that rows finish apart."""
    return [
        Sequence(f"row{i}", prompt, SamplingParams(**SETTINGS[setting], seed=100 + i), MAX_TOKENS - 3 * (i % 3))
        for i, prompt in enumerate(prompts_of(target) * copies)
    ]


def run(target: ModelRunner, drafter: Drafter | None, seqs: list[Sequence], gamma: int | None) -> list[list[int]]:
    """Decode `seqs` in one engine, the odd rows (if any) joining after 3 steps."""
    engine = Engine(target, drafter, Controller(gamma_max=4, fixed_gamma=gamma), eos_ids(target))
    decode(engine, seqs[::2], {3: seqs[1::2]} if len(seqs) > 1 else None)
    return [seq.output_ids for seq in seqs]


@pytest.fixture(scope="module")
def plain(target) -> dict[str, list[list[int]]]:
    return {setting: run(target, None, sequences(target, setting), None) for setting in SETTINGS}


@pytest.mark.parametrize("gamma", [None, 3], ids=["controller", "gamma-3"])
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_speculative_text_is_plain_decodings(target, plain, drafter, setting, gamma):
    seqs = sequences(target, setting)
    assert run(target, DRAFTERS[drafter](target), seqs, gamma) == plain[setting]
    # With a fixed gamma every step asks for drafts, and under the controller every drafter that always proposes
    # drafts too. A lookup drafter proposes only where the text repeats: with no match in a row's first steps the
    # controller, which follows measured times, may then ask it for none on a slow host.
    if gamma is not None or drafter not in LOOKUP_DRAFTERS:
        assert sum(seq.stats.draft_tokens for seq in seqs) > 0, "nothing was drafted: the comparison says nothing"


# Every drafter but those that draft in the target's slot cache (layer skip and its distilled student).
STATIC_DRAFTERS = [name for name in DRAFTERS if name not in ("layer-skip", "distilled")]


@pytest.fixture(scope="module")
def compiled_target(target) -> StaticRunner:
    return StaticRunner.of(target, compiled=True)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("drafter", [None, *STATIC_DRAFTERS])
def test_the_compiled_step_returns_the_eager_steps_text(compiled_target, plain, drafter, setting):
    """model.step compiled: plainly and with every drafter it takes (at a fixed gamma, so that it drafts whatever the
    host's timings), the eager step's plain text."""
    seqs = sequences(compiled_target, setting)
    chosen = DRAFTERS[drafter](compiled_target) if drafter else None
    assert run(compiled_target, chosen, seqs, 3 if drafter else None) == plain[setting]
    assert drafter is None or sum(seq.stats.draft_tokens for seq in seqs) > 0


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_a_request_alone_and_in_a_batch_of_eight_gets_the_same_text(target, drafter, setting):
    batch = sequences(target, setting, copies=2)[:8]
    alone = [run(target, DRAFTERS[drafter](target), [seq], None)[0] for seq in sequences(target, setting, copies=2)[:8]]
    assert run(target, DRAFTERS[drafter](target), batch, None) == alone



def test_negative_control_verify_passes_one_rounding_off_change_some_text(target, monkeypatch):
    """The same comparisons where a pass over several tokens rounds differently from one-token steps differ
    somewhere: these tests can fail, and it is a verify pass against one-token steps that parts them. SDPA's
    passes (not row-invariant) part them on some CPUs and agree by chance on others, so the control moves every
    several-token pass's attention by one bf16 rounding step, the size of difference SDPA's tiling makes."""
    sdpa = attention.sdpa_attention_forward

    def several_tokens_one_rounding_off(module, query, *args, **kwargs):
        out, weights = sdpa(module, query, *args, **kwargs)
        return (out if query.shape[-2] == 1 else out * (1 + 2.0**-8)), weights

    monkeypatch.setattr(target, "row_invariant", False)
    monkeypatch.setattr(attention, "sdpa_attention_forward", several_tokens_one_rounding_off)
    plain = {setting: run(target, None, sequences(target, setting), None) for setting in SETTINGS}
    differs = [
        (drafter, setting, gamma)
        for drafter in DRAFTERS for setting in SETTINGS for gamma in (None, 3)
        if run(target, DRAFTERS[drafter](target), sequences(target, setting), gamma) != plain[setting]
    ]
    assert differs


def test_the_flips_tool_finds_none_on_a_row_invariant_target(prompts_file):
    """specdec_tools.flips, end to end on this target's config: verify passes agree with plain decoding at
    every position."""
    config = Config(model=INT4)
    result = flips(config, load_prompts(prompts_file), max_tokens=24, k=5)
    assert result["row_invariant"] and result["positions"] > 20 and result["flipped_positions"] == 0


@pytest.mark.parametrize("unseeded_rule", ["rejection", "gumbel"])
def test_seeded_rows_always_take_the_gumbel_rule_unseeded_ones_the_configured_rule(target, unseeded_rule):
    engine = Engine(target, None, Controller(), set(), unseeded_rule=unseeded_rule)
    seeded, unseeded, greedy = (Sequence(name, [1, 2, 3], params, 4) for name, params in (
        ("seeded", SamplingParams(temperature=0.7, seed=1)), ("unseeded", SamplingParams(temperature=0.7)),
        ("greedy", SamplingParams(temperature=0.0))))
    for seq in (seeded, unseeded, greedy):
        engine.add(seq)
    assert seeded.noise is not None and greedy.noise is None
    assert (unseeded.noise is not None) == (unseeded_rule == "gumbel")
