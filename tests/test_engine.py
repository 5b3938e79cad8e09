"""The engine end to end: speculative greedy decoding equals plain greedy decoding token for token (fp32),
for every row of a ragged batch, on tiny random models and on the real SmolLM2-135M; and drafters must
share the target's tokenizer.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_core.build import build_engine
from specdec_core.config import Config, ModelConfig, SpeculationConfig
from specdec_core.control import Controller
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.drafters.ngram import NgramDrafter
from specdec_core.engine import Engine, StepReport
from specdec_core.models.loading import TokenizerMismatch, check_same_tokenizer, eos_ids, load_runner
from specdec_core.models.runner import ModelRunner, load_model
from specdec_core.models.tiny import tiny_tokenizer
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence

from .helpers import decode, full_logits, greedy_reference, tiny_runner
from .helpers import single_thread  # noqa: F401  (autouse: torch on one thread)

# Spec-Bench's questions, in the shared folder beside the repository (as `specdec bench` finds them).
QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
TINY = ModelConfig(target="tiny-random-llama", dtype="fp32", device="cpu")
TINY_LONGEST = 24
SMOL_LONGEST = 32
TINY_TEXTS = [
    "def decode(self, s, _w=WHITESPACE.match):",
    "return self.raw_decode(s, idx=_w(s, 0).end()) if self.raw_decode(s",
    "obj, end = self.scan_once(s, idx)",
    "x",  # one token
    "raise JSONDecodeError(msg, s, end) from None; raise JSONDecodeError(msg, s,",
]


# -- shared checks -----------------------------------------------------------


def layout(rows: int, longest: int) -> list[tuple[int, int]]:
    """(max_tokens, join step) per row: budgets differ so rows finish early; odd rows join mid-decode."""
    return [(longest - 3 * (i % 4), 3 * (i % 2)) for i in range(rows)]


def run_rows(engine: Engine, prompts: list[list[int]], longest: int, **params) -> tuple[list[Sequence], list[StepReport]]:
    """Decode every prompt in one engine, laid out by `layout`; check each step's report adds up."""
    seqs, joins = [], {}
    for i, (prompt, (max_tokens, join)) in enumerate(zip(prompts, layout(len(prompts), longest))):
        seqs.append(Sequence(f"row{i}", list(prompt), SamplingParams(**params), max_tokens))
        joins.setdefault(join, []).append(seqs[-1])
    reports = decode(engine, joins.pop(0), joins)
    for report in reports:
        assert sum(report.accepted_per_position) == sum(row.accepted for row in report.rows)
        assert sum(report.drafted_per_position) == sum(row.drafted for row in report.rows)
        assert (report.mode == "speculative") == (report.gamma > 0)
    assert all(seq.finished for seq in seqs)
    return seqs, reports


def assert_rows_match(seqs: list[Sequence], references: list[list[int]]) -> None:
    """Each row's output is its reference, cut at its own token budget (references stop at EOS)."""
    wrong = [(s.request_id, s.output_ids, ref[: s.max_tokens]) for s, ref in zip(seqs, references) if s.output_ids != ref[: s.max_tokens]]
    assert not wrong, f"{len(wrong)} of {len(seqs)} rows differ from plain greedy decoding: {wrong[:3]}"


def speculation(seqs: list[Sequence]) -> tuple[int, int]:
    return sum(s.stats.draft_tokens for s in seqs), sum(s.stats.accepted_tokens for s in seqs)


def ragged(reports: list[StepReport]) -> bool:
    """Some speculative step kept different numbers of draft tokens in different rows."""
    return any(len({row.accepted for row in r.rows if row.drafted}) > 1 for r in reports)


# -- tiny random models ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_target() -> ModelRunner:
    return load_runner(TINY.target, TINY)


@pytest.fixture(scope="module")
def tiny_prompts(tiny_target) -> list[list[int]]:
    prompts = [tiny_target.tokenizer.encode(text) for text in TINY_TEXTS]
    assert min(len(p) for p in prompts) == 1
    return prompts


@pytest.fixture(scope="module")
def tiny_references(tiny_target, tiny_prompts) -> list[list[int]]:
    return [greedy_reference(tiny_target, p, TINY_LONGEST, eos_ids(tiny_target)) for p in tiny_prompts]


def perturbed(runner: ModelRunner, noise: float) -> ModelRunner:
    """A draft that agrees with the target often but not always: the target's weights plus noise."""
    model = copy.deepcopy(runner.model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * noise * weight.std())
    return ModelRunner(model, runner.tokenizer, f"{runner.name}+noise")


TINY_DRAFTERS = {
    "ngram": lambda target: NgramDrafter(),
    "draft-model-random": lambda target: DraftModelDrafter(load_runner("tiny-random-llama@1", TINY), target.vocab_size),
    "draft-model-close": lambda target: DraftModelDrafter(perturbed(target, 0.1), target.vocab_size),
    # An output layer padded past the shared vocabulary (as some checkpoints ship): the padding is ignored.
    "draft-model-padded": lambda target: DraftModelDrafter(tiny_runner(seed=2, vocab=target.vocab_size + 16), target.vocab_size),
}


@pytest.mark.parametrize("gamma", [None, 1, 3], ids=["controller", "fixed-gamma-1", "fixed-gamma-3"])
@pytest.mark.parametrize("drafter", TINY_DRAFTERS)
def test_tiny_batch_rows_equal_plain_greedy_alone(tiny_target, tiny_prompts, tiny_references, drafter, gamma):
    engine = Engine(tiny_target, TINY_DRAFTERS[drafter](tiny_target), Controller(fixed_gamma=gamma), eos_ids(tiny_target))
    seqs, reports = run_rows(engine, tiny_prompts * 2, TINY_LONGEST, temperature=0)
    assert_rows_match(seqs, tiny_references * 2)
    if gamma:
        drafted, accepted = speculation(seqs)
        assert drafted > 0
        if drafter in ("ngram", "draft-model-close"):
            assert accepted > 0
        if drafter == "draft-model-close":
            assert 0 < accepted < drafted and ragged(reports)


@pytest.mark.parametrize("gamma", [None, 3], ids=["controller", "fixed-gamma-3"])
def test_rows_that_do_not_speculate_get_no_drafts_and_the_same_tokens(tiny_target, tiny_prompts, tiny_references, gamma):
    draft = DraftModelDrafter(perturbed(tiny_target, 0.1), tiny_target.vocab_size)
    engine = Engine(tiny_target, draft, Controller(fixed_gamma=gamma), eos_ids(tiny_target))
    seqs = [Sequence(f"row{i}", p, SamplingParams(temperature=0), TINY_LONGEST, speculate=i % 2 == 0)
            for i, p in enumerate(tiny_prompts)]
    reports = decode(engine, seqs)
    assert_rows_match(seqs, tiny_references)
    assert all(seq.stats.draft_tokens == 0 for seq in seqs[1::2])
    assert any(seq.stats.draft_tokens > 0 for seq in seqs[::2])
    # A batch in which no row speculates takes plain steps: the drafter is not asked.
    alone = Sequence("alone", tiny_prompts[0], SamplingParams(temperature=0), TINY_LONGEST, speculate=False)
    assert {report.mode for report in decode(engine, [alone])} == {"plain"}
    assert "speculative" in {report.mode for report in reports}


def test_tiny_config_engine_matches_plain_greedy(tiny_prompts, tiny_references):
    engine = build_engine(Config.load(Path(__file__).resolve().parents[1] / "configs" / "tiny-random.yaml"))
    assert engine.method == "draft-model" and engine.target.dtype == torch.float32
    seqs, _ = run_rows(engine, tiny_prompts, TINY_LONGEST, temperature=0)
    assert_rows_match(seqs, tiny_references)


def test_stop_token_inside_accepted_drafts_ends_the_row_there(tiny_target, tiny_prompts, tiny_references):
    reference, prompt = tiny_references[0], tiny_prompts[0]
    stop_at = next(i for i in range(4, len(reference)) if reference[i] not in reference[:i])
    stop = Sequence("stop", prompt, SamplingParams(temperature=0), TINY_LONGEST, stop_token_ids=frozenset({reference[stop_at]}), top_logprobs=2)
    other = Sequence("other", tiny_prompts[1], SamplingParams(temperature=0), TINY_LONGEST)
    draft = DraftModelDrafter(perturbed(tiny_target, 0.1), tiny_target.vocab_size)
    reports = decode(Engine(tiny_target, draft, Controller(fixed_gamma=4), eos_ids(tiny_target)), [stop, other])
    assert stop.output_ids == reference[: stop_at + 1] and stop.finish_reason == "stop"
    last = [row for report in reports for row in report.rows if row.seq is stop][-1]
    assert last.accepted + 1 > len(last.new_tokens), "the stop should fall inside the kept drafts, with more after it"
    assert other.output_ids == tiny_references[1][:TINY_LONGEST]
    # Logprobs: one per kept token, the target's own (plain decoding's) log-softmax.
    assert len(stop.token_logprobs) == len(stop.top_logprob_ids) == len(stop.output_ids)
    logprobs = full_logits(tiny_target, prompt + stop.output_ids).log_softmax(-1)[len(prompt) - 1 : -1]
    expected = logprobs.gather(1, torch.tensor(stop.output_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(stop.token_logprobs), expected, rtol=1e-4, atol=1e-4)
    assert [[i for i, _ in top] for top in stop.top_logprob_ids] == logprobs.topk(2).indices.tolist()


def test_the_first_token_is_drawn_from_the_prefill_and_a_sequence_it_finishes_never_joins(tiny_target, tiny_prompts, tiny_references):
    """The prefill's last logits draw a sequence's first token as it joins, before any step: a client has it a target
    pass sooner. One that this token finishes (one token asked for, a stop token) never joins the batch."""
    engine = Engine(tiny_target, NgramDrafter(), Controller(fixed_gamma=3), eos_ids(tiny_target))
    prompt, reference = tiny_prompts[1], tiny_references[1]
    seq = Sequence("first", prompt, SamplingParams(temperature=0), TINY_LONGEST)
    admission = engine.begin(seq)
    while not engine.advance(admission):
        pass
    assert admission.first.new_tokens == seq.output_ids == reference[:1] and engine.seqs == [seq]
    assert int(engine.cache.lengths[0]) == len(prompt)  # the whole prompt: all of the sequence but its new token
    one = Sequence("one", prompt, SamplingParams(temperature=0), 1)
    stopped = Sequence("stopped", prompt, SamplingParams(temperature=0), TINY_LONGEST, stop_token_ids=frozenset(reference[:1]))
    for short in (one, stopped):
        engine.add(short)
        assert short.output_ids == reference[:1] and engine.seqs == [seq]
    assert (one.finish_reason, stopped.finish_reason) == ("length", "stop")
    decode(engine, [])
    assert seq.output_ids == reference[:TINY_LONGEST]


def test_seeded_sampling_is_reproducible_and_ignores_the_global_rng(tiny_target, tiny_prompts):
    def sampled(global_seed: int, seed_offset: int = 0) -> list[list[int]]:
        torch.manual_seed(global_seed)
        draft = DraftModelDrafter(load_runner("tiny-random-llama@1", TINY), tiny_target.vocab_size)
        engine = Engine(tiny_target, draft, Controller(fixed_gamma=3), eos_ids(tiny_target))
        seqs = [Sequence(f"s{i}", p, SamplingParams(temperature=1.0, seed=i + seed_offset), 12) for i, p in enumerate(tiny_prompts)]
        decode(engine, seqs)
        return [seq.output_ids for seq in seqs]

    assert sampled(0) == sampled(1) != sampled(0, seed_offset=100)


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_a_row_with_nan_probabilities_fails_alone(tiny_target, tiny_prompts, drafter):
    """A NaN logit bias makes one sampled row's probabilities NaN: set before it joins, that row fails as its first
    token is drawn (it never joins); set after, in its next step, and it leaves the batch. The rows beside it,
    greedy and seeded, decode as they would without it."""

    def rows(doomed: bool) -> list[Sequence]:
        engine = Engine(tiny_target, NgramDrafter() if drafter else None, Controller(fixed_gamma=3), eos_ids(tiny_target))
        seqs = [Sequence("greedy", tiny_prompts[2] * 2, SamplingParams(temperature=0), 12),
                Sequence("seeded", tiny_prompts[0] * 2, SamplingParams(temperature=1.0, seed=3), 12)]
        if doomed:
            nan = SamplingParams(temperature=1.0, logit_bias={5: float("nan")})
            engine.add(seqs[0])
            with pytest.raises(ValueError, match="first: the target's probabilities are not finite"):
                engine.add(Sequence("first", tiny_prompts[1], nan, 12))
            seqs.insert(1, Sequence("nan", tiny_prompts[1], SamplingParams(temperature=1.0), 12))
            engine.add(seqs[1])
            seqs[1].params = nan
        reports = decode(engine, seqs[len(engine.seqs):])
        assert [seq.request_id for report in reports for seq, _ in report.failed] == (["nan"] if doomed else [])
        assert not any(row.seq.request_id == "nan" for report in reports for row in report.rows)
        return [seq for seq in seqs if seq.request_id != "nan"]

    alone = rows(doomed=False)
    beside = rows(doomed=True)
    assert [seq.output_ids for seq in beside] == [seq.output_ids for seq in alone]
    assert all(seq.finished for seq in beside)


def test_an_empty_prompt_is_refused(tiny_target):
    with pytest.raises(ValueError, match="at least one token"):
        Engine(tiny_target, None, Controller(), set()).add(Sequence("empty", [], SamplingParams(), 4))


# -- tokenizer agreement -----------------------------------------------------


def test_identical_tokenizers_pass():
    target = tiny_runner(tokenizer=tiny_tokenizer(), vocab=384)
    check_same_tokenizer(target, tiny_runner(seed=1, tokenizer=tiny_tokenizer(), vocab=384))


def test_tokenizers_differing_in_special_tokens_are_refused():
    other = tiny_tokenizer()
    other.eos_token = "<|endoftext|>"
    with pytest.raises(TokenizerMismatch, match="special"):
        check_same_tokenizer(tiny_runner(tokenizer=tiny_tokenizer()), tiny_runner(seed=1, tokenizer=other))


@pytest.mark.real_model
def test_mismatched_tokenizers_are_refused_naming_both(smollm2):
    tiny = tiny_runner(tokenizer=tiny_tokenizer(), vocab=384)
    with pytest.raises(TokenizerMismatch) as error:
        check_same_tokenizer(smollm2, tiny)
    assert repr(smollm2.name) in str(error.value) and repr(tiny.name) in str(error.value)
    check_same_tokenizer(smollm2, smollm2)


@pytest.mark.real_model
def test_build_refuses_a_draft_model_with_another_tokenizer(smollm2_dir):
    config = Config(
        model=TINY,
        speculation=SpeculationConfig(drafter="draft-model", draft_model=str(smollm2_dir)),
    )
    with pytest.raises(TokenizerMismatch) as error:
        build_engine(config)
    assert str(smollm2_dir) in str(error.value) and TINY.target in str(error.value)


# -- SmolLM2-135M in float32 -------------------------------------------------


class PrefillOnce(ModelRunner):
    """A runner that prefills each distinct prompt once and hands later engines copies.

    Prefill is a pure function of the prompt, so this changes no result; it
    saves the several engines of these tests prefilling the same prompts again.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._prefills = {}

    def prefill(self, token_ids, all_logits=False, features=False):
        key = (tuple(token_ids), all_logits, features)
        if key not in self._prefills:
            self._prefills[key] = super().prefill(token_ids, all_logits=all_logits, features=features)
        return copy.deepcopy(self._prefills[key])


@pytest.fixture(scope="module")
def smollm2(smollm2_dir) -> ModelRunner:
    model, tokenizer = load_model(str(smollm2_dir), "fp32", "cpu")
    return PrefillOnce(model, tokenizer, "smollm2-135m")


@pytest.fixture(scope="module")
def smol_prompts(smollm2) -> list[list[int]]:
    """First turns of 20 Spec-Bench questions through the chat template, and a one-token prompt."""
    if not QUESTIONS.is_file():
        pytest.skip(f"Spec-Bench questions not found at {QUESTIONS}")
    questions = [json.loads(line)["turns"][0] for line in QUESTIONS.read_text().splitlines()[:20]]
    tokenizer = smollm2.tokenizer
    prompts = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False))
        for q in questions
    ]
    return prompts + [tokenizer.encode("Hello")]


@pytest.fixture(scope="module")
def smol_references(smollm2, smol_prompts) -> list[list[int]]:
    """Plain greedy decoding of every prompt, all in one batch from the start."""
    engine = Engine(smollm2, None, Controller(), eos_ids(smollm2))
    seqs = [Sequence(f"plain{i}", p, SamplingParams(temperature=0), SMOL_LONGEST) for i, p in enumerate(smol_prompts)]
    decode(engine, seqs)
    return [seq.output_ids for seq in seqs]


def random_draft(target: ModelRunner) -> ModelRunner:
    """A small random-weight Llama over SmolLM2's vocabulary, sharing its tokenizer."""
    config = LlamaConfig(
        vocab_size=target.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    draft = ModelRunner(LlamaForCausalLM(config).eval(), target.tokenizer, "random-llama-draft")
    check_same_tokenizer(target, draft)
    return draft


SMOL_DRAFTERS = {
    "ngram": lambda target: NgramDrafter(),
    "draft-model": lambda target: DraftModelDrafter(random_draft(target), target.vocab_size),
}


@pytest.mark.real_model
def test_smollm2_plain_batch_equals_hf_generate_alone(smollm2, smol_prompts, smol_references):
    """The reference itself: batched plain decoding equals transformers' own greedy generate, row alone."""
    lengths = [len(p) for p in smol_prompts]
    for i in (lengths.index(min(lengths[:20])), lengths.index(max(lengths)), lengths.index(1)):
        ids = torch.tensor([smol_prompts[i]])
        out = smollm2.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=SMOL_LONGEST, do_sample=False,
            eos_token_id=sorted(eos_ids(smollm2)), pad_token_id=smollm2.tokenizer.eos_token_id,
        )
        assert out[0, ids.shape[1] :].tolist() == smol_references[i]


@pytest.mark.real_model
@pytest.mark.parametrize("gamma", [None, 4], ids=["controller", "fixed-gamma"])
@pytest.mark.parametrize("drafter", SMOL_DRAFTERS)
def test_smollm2_speculative_greedy_equals_plain(smollm2, smol_prompts, smol_references, drafter, gamma):
    engine = Engine(smollm2, SMOL_DRAFTERS[drafter](smollm2), Controller(fixed_gamma=gamma), eos_ids(smollm2))
    seqs, reports = run_rows(engine, smol_prompts, SMOL_LONGEST, temperature=0)
    assert_rows_match(seqs, smol_references)
    if gamma:
        drafted, accepted = speculation(seqs)
        assert drafted > 0 and sum(r.mode == "speculative" for r in reports) > len(reports) / 2
        if drafter == "ngram":
            assert accepted > 0 and ragged(reports)
