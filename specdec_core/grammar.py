"""Grammars that constrain what a sequence may say: any JSON, a JSON schema, a model's tool calls.

xgrammar compiles a format into a token automaton and fills, for a parser
state, the bitmask of the tokens that may come next. It was chosen by the
per-token mask cost measured on the 151,936-token Qwen2.5 vocabulary
(`python -m specdec_tools.grammar_cost`, docs/NOTES.md): a few microseconds,
against tens for llguidance, with outlines-core's index compiled per schema
in a fifth of a second and no rollback. It also rolls back, forks, and knows
model families' tool-call formats.

Exactness under speculation: at every output position the target's logits
are masked by the grammar's state after the tokens before it, before
anything else touches them (vLLM's order: the mask, then logit_bias and
penalties, temperature, top-k, top-p), so the distribution is the target's,
masked and renormalised, as in constrained plain decoding. A step's masks
come from walking the matcher down the proposal (depth first through a
tree) and rolling it back; a draft the grammar forbids is cut with what
follows it, since the masked target could never keep it. The matcher
advances only by the tokens a step emits.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
import numpy as np
import torch
import xgrammar as xgr

from .tree import children

# Keywords xgrammar enforces (each checked: an instance breaking it is refused), and those that only annotate.
ENFORCED = frozenset({
    "type", "properties", "required", "additionalProperties", "patternProperties", "propertyNames", "minProperties",
    "maxProperties", "items", "prefixItems", "minItems", "maxItems", "enum", "const", "anyOf", "allOf", "$ref", "$defs",
    "definitions", "pattern", "format", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf",
})
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$anchor", "$comment", "deprecated", "readOnly",
    "writeOnly",
})
FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "uri", "uri-reference", "uuid", "ipv4", "ipv6", "hostname"})
# Keywords whose values are schemas: a name to one, a name to a map of them, a name to a list of them.
ONE_SCHEMA = ("additionalProperties", "items", "propertyNames")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SCHEMA_LISTS = ("prefixItems", "anyOf", "allOf")


CompiledGrammar = xgr.CompiledGrammar


class GrammarError(ValueError):
    """A format that cannot constrain decoding: the request's to fix. `field` names where, as the client wrote it."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class GrammarSpec:
    """A format to compile: a JSON schema, or an xgrammar structural tag (tool calls)."""

    kind: Literal["json_schema", "structural_tag"]
    source: str = ""  # the schema or tag as JSON text

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.kind}\n{self.source}".encode()).hexdigest()


def check_schema(schema: Any, field: str) -> None:
    """Refuse a schema that is not JSON Schema, or that asks for what the grammar would not enforce (so that every
    output validates): GrammarError naming the keyword's place under `field`."""
    if not isinstance(schema, dict):
        raise GrammarError(f"{field} must be a JSON Schema object", field)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in exc.path)
        raise GrammarError(f"{field} is not a valid JSON Schema: {field}{where}: {exc.message}", field) from None
    _check_keywords(schema, field)


def _check_keywords(schema: Any, at: str) -> None:
    if isinstance(schema, bool):
        return
    for keyword, value in schema.items():
        where = f"{at}.{keyword}"
        if keyword in ANNOTATIONS:
            continue
        if keyword == "uniqueItems" and value is False:  # false asks for nothing
            continue
        if keyword not in ENFORCED:
            hint = " (xgrammar treats it as anyOf, which lets an instance match two branches); use anyOf" if keyword == "oneOf" else ""
            raise GrammarError(f"{where}: the keyword {keyword!r} is not supported by structured outputs{hint}", where)
        if keyword == "format" and value not in FORMATS:
            raise GrammarError(f"{where}: the format {value!r} is not supported; supported: {', '.join(sorted(FORMATS))}", where)
        if keyword == "allOf" and len(value) > 1:
            raise GrammarError(f"{where}: allOf with more than one schema is not supported; merge them into one", where)
        if keyword in ONE_SCHEMA:
            _check_keywords(value, where)
        elif keyword in SCHEMA_MAPS:
            for name, sub in value.items():
                _check_keywords(sub, f"{where}.{name}")
        elif keyword in SCHEMA_LISTS:
            for i, sub in enumerate(value):
                _check_keywords(sub, f"{where}[{i}]")


class Grammars:
    """Compiles formats for one tokenizer, each once (kept by its hash, least recently used leaving first), and
    makes each sequence's matcher. A compile past `timeout_s` fails its request; it runs on in its own thread and
    is kept, so nothing else waits behind it."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int], timeout_s: float = 5.0,
                 cache_entries: int = 256, on_compile: Callable[[float], None] | None = None):
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.vocabulary = Vocabulary(self.info, vocab_size, tokenizer.eos_token_id, stop_token_ids)
        self.timeout_s = timeout_s
        self.cache_entries = cache_entries
        self._compiled: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.on_compile = on_compile  # told each compile's seconds (metrics)

    def compile(self, spec: GrammarSpec, field: str) -> CompiledGrammar:
        """The compiled grammar of spec; GrammarError (naming `field`) for one xgrammar refuses or that takes too long."""
        with self._lock:
            future = self._compiled.get(spec.digest)
            if future is None:
                future = self._compiled[spec.digest] = Future()
                threading.Thread(target=self._run, args=(spec, future), daemon=True, name="specdec-grammar").start()
                while len(self._compiled) > self.cache_entries:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(spec.digest)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise GrammarError(
                f"{field} took longer than {self.timeout_s:g} s to compile into a grammar (grammar.compile_timeout_s); "
                "simplify the schema", field,
            ) from None
        except (RuntimeError, ValueError) as exc:  # xgrammar's words for what it cannot take
            reason = str(exc).strip().splitlines()[-1]
            raise GrammarError(f"{field} cannot be compiled into a grammar: {reason}", field) from None

    def _run(self, spec: GrammarSpec, future: Future) -> None:
        start = time.perf_counter()
        try:
            if spec.kind == "json_schema":
                # Not strict: a schema's unlisted properties stay allowed, as JSON Schema says; compact separators.
                source = json.dumps(_bounded_strings(json.loads(spec.source)))
                compiled = self.compiler.compile_json_schema(source, any_whitespace=False, strict_mode=False)
            else:
                compiled = self.compiler.compile_structural_tag(spec.source)
        except Exception as exc:
            future.set_exception(exc)
            return
        if self.on_compile:
            self.on_compile(time.perf_counter() - start)
        future.set_result(compiled)

    def state(self, compiled: CompiledGrammar) -> GrammarState:
        """A new sequence's matcher; it ends at any of the stop tokens (those the engine ends a sequence at)."""
        return GrammarState(xgr.GrammarMatcher(compiled), self.vocabulary)


# xgrammar 0.2.9 spells a string with minLength or maxLength as {n,m} of [^"\\\r\n], which lets raw control
# characters through (invalid JSON) and no escapes: the same bounds as a pattern of plain characters hold.
PLAIN_CHARACTERS = r'[^\x00-\x1f"\\]'
DATA_KEYWORDS = ("enum", "const", "default", "examples")  # their values are instances, not schemas


def _bounded_strings(schema: Any) -> Any:
    """The schema with each length-bounded string (no pattern, no format) bounded by a pattern instead."""
    if isinstance(schema, list):
        return [_bounded_strings(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in DATA_KEYWORDS else _bounded_strings(value) for key, value in schema.items()}
    lengths = [out.get(key) for key in ("minLength", "maxLength")]
    if any(isinstance(n, int) and not isinstance(n, bool) for n in lengths) and "pattern" not in out and "format" not in out:
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^{PLAIN_CHARACTERS}{{{low},{high}}}$"
    return out


# UTF-8 across tokens, strictly: xgrammar 0.2.9 takes any lead byte and continuation bytes as a character, overlong
# forms (E0 82 8D for U+008D) and surrogates too, which decode to U+FFFD each and break a string's maxLength. A state
# is what the next byte must be: (continuation bytes still due, the first one's lowest and highest value).
UTF8_START = (0, 0, 0)
UTF8_LEADS = [(range(0xC2, 0xE0), (1, 0x80, 0xBF)), (range(0xE0, 0xE1), (2, 0xA0, 0xBF)), (range(0xE1, 0xED), (2, 0x80, 0xBF)),
              (range(0xED, 0xEE), (2, 0x80, 0x9F)), (range(0xEE, 0xF0), (2, 0x80, 0xBF)), (range(0xF0, 0xF1), (3, 0x90, 0xBF)),
              (range(0xF1, 0xF4), (3, 0x80, 0xBF)), (range(0xF4, 0xF5), (3, 0x80, 0x8F))]


def utf8_after(state: tuple[int, int, int], data: bytes) -> tuple[int, int, int] | None:
    """The UTF-8 state after `data` from `state`; None where the bytes cannot be valid UTF-8 there."""
    due, low, high = state
    for byte in data:
        if due:
            if not low <= byte <= high:
                return None
            due, low, high = due - 1, 0x80, 0xBF
        elif byte >= 0x80:
            lead = next((after for leads, after in UTF8_LEADS if byte in leads), None)
            if lead is None:
                return None
            due, low, high = lead
    return (due, low, high) if due else UTF8_START


class Vocabulary:
    """What the grammar drafter needs of the vocabulary: each token's bytes, the token that spells exactly some
    bytes, the end-of-sequence token to draft, and the mask that allows only the stop tokens."""

    def __init__(self, info: xgr.TokenizerInfo, size: int, eos_token_id: int | None, stop_token_ids: set[int]):
        self.size = size
        self.bytes = info.decoded_vocab
        special = set(info.special_token_ids) | set(stop_token_ids)
        self.token_of: dict[bytes, int] = {}
        for token, text in enumerate(self.bytes):
            if text and token not in special:
                self.token_of.setdefault(text, token)
        self.eos = eos_token_id if eos_token_id in stop_token_ids else min(stop_token_ids)
        self.stops_only = torch.zeros(xgr.get_bitmask_shape(1, size), dtype=xgr.bitmask_dtype)
        for token in stop_token_ids:
            self.stops_only[0, token // 32] |= _bit(token % 32)
        self._utf8_masks: dict[tuple[int, int, int], torch.Tensor] = {}
        self.utf8_mask(UTF8_START)  # at start, not on the first structured request's step: a pass over the vocabulary

    def utf8_mask(self, state: tuple[int, int, int]) -> torch.Tensor:
        """[W]: the tokens whose bytes can follow UTF-8 state `state` (made once per state)."""
        if state not in self._utf8_masks:
            allowed = np.ones(-(-self.size // 32) * 32, dtype=np.uint64)
            for token, text in enumerate(self.bytes[: self.size]):
                if text and (not text.isascii() or state != UTF8_START) and utf8_after(state, text) is None:
                    allowed[token] = 0
            words = (allowed.reshape(-1, 32) << np.arange(32, dtype=np.uint64)).sum(axis=1).astype(np.uint32)
            self._utf8_masks[state] = torch.from_numpy(words.view(np.int32).copy())
        return self._utf8_masks[state]


def _bit(position: int) -> int:
    """An int32 with bit `position` set (bit 31 is the sign)."""
    return -(2**31) if position == 31 else 1 << position


class GrammarState:
    """One sequence's place in its grammar: the masks for a step's proposal, and the tokens it forces."""

    def __init__(self, matcher: xgr.GrammarMatcher, vocabulary: Vocabulary):
        self.matcher = matcher
        self.vocabulary = vocabulary
        self.utf8 = [UTF8_START]  # the UTF-8 state after each accepted token, rolled back with the matcher

    def _masks(self, rows: int) -> torch.Tensor:
        # All tokens allowed: what a position past a stop keeps (never read: the sequence ends at the stop).
        return torch.full(xgr.get_bitmask_shape(rows, self.vocabulary.size), -1, dtype=xgr.bitmask_dtype)

    def _fill(self, masks: torch.Tensor, row: int) -> None:
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(masks, row)
            masks[row] &= self.vocabulary.utf8_mask(self.utf8[-1])

    def _accept(self, token: int) -> bool:
        if self.matcher.is_terminated():
            return False
        after = utf8_after(self.utf8[-1], self.vocabulary.bytes[token]) if token < len(self.vocabulary.bytes) else self.utf8[-1]
        if after is None or not self.matcher.accept_token(token):
            return False
        self.utf8.append(after)
        return True

    def _rollback(self, tokens: int) -> None:
        self.matcher.rollback(tokens)
        del self.utf8[len(self.utf8) - tokens :]

    def walk_chain(self, drafts: list[int]) -> tuple[int, torch.Tensor]:
        """How many leading drafts the grammar allows, and the bitmasks [that + 1, W] after the row's last token,
        then after each allowed draft. The state is as before."""
        masks = self._masks(len(drafts) + 1)
        self._fill(masks, 0)
        allowed = 0
        for token in drafts:
            if not self._accept(token):
                break
            allowed += 1
            self._fill(masks, allowed)
        self._rollback(allowed)
        return allowed, masks[: allowed + 1]

    def walk_tree(self, tokens: list[int], parents: list[int]) -> tuple[list[int], torch.Tensor]:
        """The nodes the grammar allows (each with all its ancestors), in order, and bitmasks [len(those) + 1, W]
        after the root then after each of them. Depth first, rolling back; the state is as before."""
        kids = children(parents)
        masks = self._masks(len(tokens) + 1)
        allowed: list[int] = []

        def visit(at: int) -> None:  # at: 0 the root, j + 1 node j; the matcher is in the state after it
            self._fill(masks, at)
            for node in kids[at]:
                if self._accept(tokens[node]):
                    allowed.append(node)
                    visit(node + 1)
                    self._rollback(1)

        visit(0)
        allowed.sort()
        return allowed, masks[[0] + [node + 1 for node in allowed]]

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar's forced continuation spells from here, a draft the target mostly
        keeps: the matcher's jump-forward string in the longest vocabulary tokens, its last piece too where one
        token spells it (xgrammar leaves out a piece that longer tokens begin with, such as the ` "` before a
        string value, which models mostly write as a token of its own), then the end of sequence where nothing
        else may follow. The state is as before."""
        if limit <= 0 or self.matcher.is_terminated():
            return []
        vocabulary = self.vocabulary
        tokens = self.matcher.find_jump_forward_tokens()
        spelled = b"".join(vocabulary.bytes[token] for token in tokens)
        forced = self.matcher.find_jump_forward_string().encode()
        last = vocabulary.token_of.get(forced[len(spelled):]) if forced.startswith(spelled) else None
        if last is not None:
            tokens.append(last)
        if len(tokens) < limit and self._only_stops_after(tokens):
            tokens.append(vocabulary.eos)
        return tokens[:limit]

    def _only_stops_after(self, tokens: list[int]) -> bool:
        """Whether, after `tokens`, the grammar allows nothing but a stop token. The state is as before."""
        accepted = 0
        for token in tokens:
            if not self._accept(token):
                break
            accepted += 1
        only_stops = False
        if accepted == len(tokens) and self.matcher.is_completed() and not self.matcher.is_terminated():
            mask = self._masks(1)
            self._fill(mask, 0)
            only_stops = torch.equal(mask, self.vocabulary.stops_only)
        self._rollback(accepted)
        return only_stops

    def advance(self, tokens: list[int]) -> None:
        """The tokens a step emitted (each allowed: drawn from masked logits, or a draft the walk allowed)."""
        for token in tokens:
            if not self._accept(token):
                raise RuntimeError(f"the grammar refused emitted token {token}: masks and emitted tokens disagree")


def masked(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits [k, V] with the tokens masks [k, W] forbid at -inf (a copy: the raw logits still give logprobs)."""
    logits = logits.clone()
    xgr.apply_token_bitmask_inplace(logits, masks.to(logits.device), vocab_size=logits.shape[-1])
    return logits

