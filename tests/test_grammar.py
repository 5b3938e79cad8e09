"""Structured outputs in the engine: constrained text is constrained plain decoding's for every drafter (chains
and trees, greedy and seeded, rows joining mid-run), every output that ends by stop is valid against its schema,
the grammar's forced drafts are counted apart, and schemas the grammar would not enforce are refused."""

from __future__ import annotations

import json
import string
import time

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec_core.config import ModelConfig
from specdec_core.control import Controller
from specdec_core.drafters.base import Proposal
from specdec_core.drafters.ngram import NgramDrafter
from specdec_core.drafters.suffix import SuffixDrafter
from specdec_core.engine import Engine
from specdec_core.grammar import UTF8_START, GrammarError, Grammars, GrammarSpec, GrammarState, check_schema, utf8_after
from specdec_core.models.loading import eos_ids, load_runner
from specdec_core.models.runner import ModelRunner
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence

from .helpers import (
    decode,
    single_thread,  # noqa: F401  (autouse: torch on one thread)
)
from .test_invisible import DRAFTERS, INT4, prompts_of

SCHEMA = {
    "type": "object",
    "properties": {
        "note": {"type": "string", "maxLength": 10},
        "kind": {"enum": ["cat", "dog", "parrot"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["note", "kind", "tags"],
}
SETTINGS = {"greedy": {"temperature": 0.0}, "seeded-0.7": {"temperature": 0.7, "top_p": 0.95}}
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def target() -> ModelRunner:
    return load_runner(INT4.target, INT4)


@pytest.fixture(scope="module")
def grammars(target) -> Grammars:
    return Grammars(target.tokenizer, target.vocab_size, eos_ids(target))


def constrained(target: ModelRunner, grammars: Grammars, setting: str, schema: dict = SCHEMA) -> list[Sequence]:
    """Each prompt twice, each row its own seed and budget, all bound to the schema."""
    compiled = grammars.compile(GrammarSpec("json_schema", json.dumps(schema)), "schema")
    seqs = []
    for i, prompt in enumerate(prompts_of(target) * 2):
        seq = Sequence(f"row{i}", prompt, SamplingParams(**SETTINGS[setting], seed=100 + i), MAX_TOKENS - 5 * (i % 3))
        seq.grammar = grammars.state(compiled)
        seqs.append(seq)
    return seqs


def run(target: ModelRunner, drafter, seqs: list[Sequence], gamma: int | None = 3) -> list[list[int]]:
    """Decode `seqs` in one engine, the odd rows joining after 3 steps."""
    engine = Engine(target, drafter, Controller(gamma_max=4, fixed_gamma=gamma), eos_ids(target))
    decode(engine, seqs[::2], {3: seqs[1::2]})
    return [seq.output_ids for seq in seqs]


def assert_valid(target: ModelRunner, seqs: list[Sequence], schema: dict) -> int:
    """Every output that ended by stop parses and validates; returns how many did."""
    stopped = [seq for seq in seqs if seq.finish_reason == "stop"]
    for seq in stopped:
        text = target.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            raise AssertionError(f"{text!r} is not valid against {json.dumps(schema)}") from exc
    return len(stopped)


@pytest.fixture(scope="module")
def plain(target, grammars) -> dict[str, list[list[int]]]:
    out = {}
    for setting in SETTINGS:
        seqs = constrained(target, grammars, setting)
        out[setting] = run(target, None, seqs, None)
        assert assert_valid(target, seqs, SCHEMA) > 0, "no row ended by stop: validity says nothing"
    return out


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_constrained_speculative_text_is_constrained_plain_decodings(target, grammars, plain, drafter, setting):
    seqs = constrained(target, grammars, setting)
    assert run(target, DRAFTERS[drafter](target), seqs) == plain[setting]
    assert sum(seq.stats.draft_tokens for seq in seqs) > 0, "the drafter drafted nothing: the comparison says little"
    assert sum(seq.stats.grammar_draft_tokens for seq in seqs) > 0
    assert_valid(target, seqs, SCHEMA)


def test_the_controllers_choice_keeps_the_text(target, grammars, plain):
    seqs = constrained(target, grammars, "greedy")
    assert run(target, SuffixDrafter(10_000, factor=2.0, min_probability=0.0), seqs, gamma=None) == plain["greedy"]


def test_negative_control_drafts_unchecked_by_the_grammar_change_the_text(target, grammars, plain, monkeypatch):
    """Masks that do not follow the drafts (every position gets the state before them), the grammar never cutting
    a draft: the same comparison fails, so it can."""

    def unchecked_chain(self: GrammarState, drafts: list[int]) -> tuple[int, torch.Tensor]:
        masks = self._masks(len(drafts) + 1)
        for row in range(len(drafts) + 1):
            self._fill(masks, row)
        return len(drafts), masks

    def unchecked_tree(self: GrammarState, tokens: list[int], parents: list[int]) -> tuple[list[int], torch.Tensor]:
        return list(range(len(tokens))), unchecked_chain(self, tokens)[1]

    monkeypatch.setattr(GrammarState, "walk_chain", unchecked_chain)
    monkeypatch.setattr(GrammarState, "walk_tree", unchecked_tree)
    monkeypatch.setattr(GrammarState, "advance", lambda self, tokens: None)  # it would refuse what slipped through
    seqs = constrained(target, grammars, "greedy")
    assert run(target, NgramDrafter(), seqs) != plain["greedy"]


EXTRACT = ("Extract the person as JSON. Text: Dr. Margaret Hamilton-Smith works at Northwind Robotics in Lyon "
           "for 68,500 EUR a year.")
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "company": {"type": "string"},
                                           "city": {"type": "string"},
                                           "salary": {"type": "integer", "minimum": 0, "maximum": 999999}},
          "required": ["name", "company", "city", "salary"], "additionalProperties": False}


def test_suffix_drafts_json_values_from_the_prompts_text(smollm2_dir):
    """A value copied from the prompt starts with other token boundaries than the prompt's (no token suffix
    matches): the suffix drafter finds it as text, and the text stays constrained plain decoding's (SmolLM2,
    int8: row-invariant passes)."""
    target = load_runner(str(smollm2_dir), ModelConfig(target="smollm2-135m", dtype="bf16", weights="int8"))
    grammars = Grammars(target.tokenizer, target.vocab_size, eos_ids(target))
    compiled = grammars.compile(GrammarSpec("json_schema", json.dumps(PERSON)), "schema")
    prompt = target.tokenizer.apply_chat_template([{"role": "user", "content": EXTRACT}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)

    def decoded(drafter) -> tuple[Sequence, int]:
        seq = Sequence("extract", list(prompt), SamplingParams(temperature=0), 80)
        seq.grammar = grammars.state(compiled)
        steps = len(decode(Engine(target, drafter, Controller(fixed_gamma=4), eos_ids(target)), [seq]))
        return seq, steps

    (plain, _), (by_tokens, token_steps), (by_values, value_steps) = (
        decoded(None), decoded(SuffixDrafter(10_000)), decoded(SuffixDrafter(10_000, tokenizer=target.tokenizer)))
    assert by_values.output_ids == by_tokens.output_ids == plain.output_ids
    text = target.tokenizer.decode(plain.output_ids)
    assert "Northwind Robotics" in text and "68500" in text, text  # values copied from the prompt
    assert value_steps < token_steps


def test_forced_drafts_are_counted_apart_from_the_drafters(target, grammars):
    """An n-gram drafter that finds nothing drafts nothing; what the grammar forced is counted as its own, and
    kept where the target says the same."""
    seqs = constrained(target, grammars, "greedy")
    run(target, NgramDrafter(min_n=50, max_n=50), seqs)
    stats = [seq.stats for seq in seqs]
    assert sum(s.draft_tokens for s in stats) == 0 and sum(s.verify_steps for s in stats) == 0
    assert sum(s.grammar_accepted_tokens for s in stats) > 0
    assert all(s.grammar_accepted_tokens <= s.grammar_draft_tokens for s in stats)


def test_grammar_drafts_are_off_when_configured_so(target, grammars, plain):
    seqs = constrained(target, grammars, "greedy")
    engine = Engine(target, NgramDrafter(), Controller(gamma_max=4, fixed_gamma=3), eos_ids(target), grammar_draft_tokens=0)
    decode(engine, seqs[::2], {3: seqs[1::2]})
    assert [seq.output_ids for seq in seqs] == plain["greedy"]
    assert sum(seq.stats.grammar_draft_tokens for seq in seqs) == 0


# -- schemas of the kinds JSONSchemaBench collects ---------------------------------------------------------------------

NAMES = st.text(string.ascii_lowercase, min_size=1, max_size=6)
LEAVES = st.one_of(
    st.just({"type": "string"}),
    st.integers(1, 12).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-50, 50), st.integers(0, 500)).map(lambda r: {"type": "integer", "minimum": r[0], "maximum": r[0] + r[1]}),
    st.tuples(st.integers(-9, 9), st.integers(1, 99)).map(lambda r: {"type": "number", "minimum": r[0], "maximum": r[0] + r[1]}),
    st.lists(NAMES, min_size=1, max_size=4, unique=True).map(lambda values: {"enum": values}),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"type": "string", "format": "date"}]),
)


def _object(props: dict[str, dict], data: st.DataObject) -> dict:
    required = data.draw(st.lists(st.sampled_from(sorted(props)), unique=True))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


SCHEMAS = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.tuples(inner, st.integers(0, 2), st.integers(0, 3)).map(
            lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}),
        st.tuples(st.dictionaries(NAMES, inner, min_size=1, max_size=4), st.data()).map(lambda t: _object(*t)),
    ),
    max_leaves=8,
)


RANDOM_OBJECTS = st.tuples(st.dictionaries(NAMES, SCHEMAS, min_size=1, max_size=4), st.data()).map(lambda t: _object(*t))


def sampled_rows(target: ModelRunner, grammars: Grammars, schema: dict) -> list[Sequence]:
    """Three sampled rows bound to `schema`, decoded through the suffix drafter and the grammar's drafts."""
    compiled = grammars.compile(GrammarSpec("json_schema", json.dumps(schema)), "schema")
    seqs = []
    for seed, prompt in enumerate(prompts_of(target)[:3]):
        seq = Sequence(f"s{seed}", prompt, SamplingParams(temperature=0.8, seed=seed), 160)
        seq.grammar = grammars.state(compiled)
        seqs.append(seq)
    decode(Engine(target, SuffixDrafter(10_000), Controller(gamma_max=4, fixed_gamma=3), eos_ids(target)), seqs)
    return seqs


def test_outputs_that_end_by_stop_are_valid_against_random_schemas(target, grammars):
    """30 schemas (a fixed draw), three sampled rows each through the suffix drafter and the grammar's drafts."""
    stopped, rows = [], []

    @settings(max_examples=30, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(schema=RANDOM_OBJECTS)
    def valid(schema: dict) -> None:
        check_schema(schema, "schema")
        seqs = sampled_rows(target, grammars, schema)
        stopped.append(assert_valid(target, seqs, schema))
        rows.append(len(seqs))

    valid()
    assert sum(stopped) >= sum(rows) * 3 // 4, f"only {sum(stopped)} of {sum(rows)} rows ended by stop: the check is thin"


# -- what the grammar refuses ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schema, where, words", [
    ({"type": "object", "properties": {"a": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}},
     "schema.properties.a.oneOf", "use anyOf"),
    ({"type": "array", "uniqueItems": True}, "schema.uniqueItems", "not supported"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "color"}}}, "schema.properties.a.format", "color"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "schema.allOf", "merge"),
    ({"not": {"type": "string"}}, "schema.not", "not supported"),
    ({"type": "nonsense"}, "schema", "not a valid JSON Schema"),
    ({"type": "object", "properties": {"a": {"minimum": "x"}}}, "schema", "not a valid JSON Schema"),
    (["not", "an", "object"], "schema", "JSON Schema object"),
])
def test_schemas_the_grammar_would_not_enforce_are_refused_by_name(schema, where, words):
    with pytest.raises(GrammarError) as caught:
        check_schema(schema, "schema")
    assert caught.value.field == where and words in str(caught.value)


def test_supported_schemas_pass_the_check():
    check_schema(SCHEMA, "schema")
    check_schema({"$defs": {"p": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/p"},
                  "uniqueItems": False, "title": "t", "allOf": [{"minItems": 1}]}, "schema")


def test_a_compile_past_its_limit_is_refused_and_a_schema_compiles_once(target, monkeypatch):
    compile_slowly = Grammars._run
    monkeypatch.setattr(Grammars, "_run", lambda self, spec, future: (time.sleep(1.0), compile_slowly(self, spec, future)))
    slow = Grammars(target.tokenizer, target.vocab_size, eos_ids(target), timeout_s=0.05)
    with pytest.raises(GrammarError, match="compile_timeout_s"):
        slow.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)), "response_format")
    monkeypatch.undo()
    compiles = []
    grammars = Grammars(target.tokenizer, target.vocab_size, eos_ids(target), on_compile=compiles.append)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    assert grammars.compile(spec, "x") is grammars.compile(spec, "x")
    assert len(compiles) == 1


def test_a_schema_xgrammar_cannot_compile_is_the_clients_error(grammars):
    with pytest.raises(GrammarError, match="cannot be compiled") as caught:
        grammars.compile(GrammarSpec("json_schema", json.dumps({"type": "array", "minItems": 3, "maxItems": 1})), "f")
    assert caught.value.field == "f"


def test_a_proposal_keeps_nodes_renumbered_with_their_q():
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15]])
    probs = torch.arange(6.0)[None, :, None].repeat(1, 1, 2)
    proposal = Proposal(tokens, [6], probs, [[-1, -1, 0, 0, 2, 1]], forced=[1], origin=[[-1, 0, 1, 2, 3, 4]])
    kept = proposal.keep([[0, 1, 2, 4]])
    assert kept.tokens.tolist() == [[10, 11, 12, 14]] and kept.parents == [[-1, -1, 0, 2]]
    assert kept.probs[0, :, 0].tolist() == [0, 1, 2, 4] and kept.forced == [1] and kept.origin == [[-1, 0, 1, 3]]


def test_the_grammar_forces_whole_keys_and_the_end_of_sequence(target, grammars):
    """The forced draft spells the whole jump-forward string where whole tokens can (xgrammar's own tokens leave
    out the last piece when longer tokens begin with it), and at a finished object it is the end of sequence."""
    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "size": {"type": "integer"}},
              "required": ["kind", "size"], "additionalProperties": False}
    state = grammars.state(grammars.compile(GrammarSpec("json_schema", json.dumps(schema)), "schema"))
    forced = state.forced(16)
    spelled = b"".join(grammars.vocabulary.bytes[token] for token in forced)
    assert spelled == state.matcher.find_jump_forward_string().encode() == b'{"kind": "'
    assert len(forced) > len(state.matcher.find_jump_forward_tokens())
    state.advance(forced)
    state.advance(target.tokenizer.encode('dog", "size": 3}'))
    assert state.forced(16) == [grammars.vocabulary.eos] and state.forced(0) == []
    state.advance([grammars.vocabulary.eos])
    assert state.forced(16) == []


# -- UTF-8 ---------------------------------------------------------------------------------------------------------------


def test_utf8_states_refuse_overlong_forms_surrogates_and_bytes_past_the_range():
    assert utf8_after(UTF8_START, "é༨😀 ascii".encode()) == UTF8_START
    assert utf8_after(UTF8_START, b"\xe0") == (2, 0xA0, 0xBF)
    assert utf8_after(utf8_after(UTF8_START, b"\xe0\xbc"), b"\xa8 and more") == UTF8_START  # a character across tokens
    for invalid in (b"\xe0\x82", b"\xed\xa0", b"\xf0\x80", b"\xf4\x90", b"\xc0", b"\xc1", b"\xf5", b"\xff", b"\x80", b"\xc3a"):
        assert utf8_after(UTF8_START, invalid) is None, invalid


def test_a_bounded_string_holds_whole_characters(target, grammars):
    """xgrammar took the overlong E0 82 8D as one character of this string (seed 2, this tiny target), which Python
    decodes as three U+FFFD: the UTF-8 states must refuse it."""
    schema = {"type": "object", "properties": {"aaaaek": {"type": "object", "properties": {
        "ddo": {"type": "string", "maxLength": 1}}, "required": ["ddo"], "additionalProperties": False}},
        "required": ["aaaaek"], "additionalProperties": False}
    seqs = sampled_rows(target, grammars, schema)
    assert assert_valid(target, seqs, schema) == 3
    for seq in seqs:
        text = b"".join(grammars.vocabulary.bytes[t] for t in seq.output_ids if t not in eos_ids(target))
        text.decode("utf-8")  # strict: raises on an overlong form or a lone byte
