"""Suffix drafter (SuffixDecoding, Oliaro et al. 2025): token trees from the text a request repeats, and
from what earlier requests produced.

Two memories answer the same question, "where did the text just before the cursor occur, and what
followed it?": the request's own prompt and output, and a global memory of earlier requests' outputs
(bounded by `max_tokens`, least recently used requests evicted first). The pattern is the longest suffix
of the row's tokens found in either memory (up to `max_match` tokens). Every occurrence of it votes for
the tokens that followed, and the votes make a tree of continuations: a node's count is the number of
occurrences whose continuation passes through it, and count / occurrences estimates the probability
that the target goes that way. Nodes are taken best first while that estimate is at least
`min_probability`, up to `factor` x the match length nodes: a long match earns a large tree, a short
one a small tree or none. The tree is deterministic (siblings are distinct tokens, q one-hot), so the
engine's exact tree verification keeps the target's distribution.

Both memories index every bigram of their documents by where it ends, and grow by appending: a step
costs O(new tokens) to update and O(candidates x match length) to look up, never a rescan. Which
client's outputs a request may draft from is the privacy question: drafts never change what a request
receives (verification is exact), but a faster answer can tell a client that someone's text is in the
memory, a timing side channel. So by default each client (API key, else address) drafts only from its
own earlier requests; `shared` pools them.

Under a grammar (JSON), a value copied from the prompt is spelled with other token boundaries: `"Senior`
after a quote where the prompt has ` Senior`, so no token suffix matches until the value's third token.
For such rows the drafter also looks up the string value being written, as text, in the row's prompt,
and drafts what followed it there, tokenized afresh (`_value_tree`).
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..models.runner import BatchCache
from ..sequence import Sequence
from ..tree import continuation_tree
from .base import Drafter, DrafterBuilder, Proposal

if TYPE_CHECKING:
    from ..config import Config
    from ..models.runner import ModelRunner

KEY = 2  # tokens of the index's key: a match is at least this long
MAX_CANDIDATES = 64  # most recent occurrences of the key examined per lookup and memory
VALUE_WINDOW = 64  # characters of the prompt after a value's occurrence, tokenized into its continuation
NUMBER_TAIL = re.compile(r"[:\[,]\s*(\d+)$")  # the digits of a JSON number being written, at the output's end
THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")  # English thousands separators, which JSON numbers lack


@dataclass
class Document:
    """One request's tokens in a memory, and whose they are."""

    id: int
    owner: str | None
    tokens: list[int] = field(default_factory=list)


class TokenMemory:
    """Documents of tokens, indexed by each bigram's end position; appended to, and evicted whole (LRU).

    Evicting leaves the evicted document's index entries behind, skipped by lookups, and rebuilds the index
    once they outnumber the live ones: eviction then costs O(1) per token, amortized, like appending.
    """

    def __init__(self, max_tokens: int | None = None):
        self.max_tokens = max_tokens
        self.documents: OrderedDict[int, Document] = OrderedDict()  # least recently used first
        self.index: defaultdict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)  # key -> (doc, end)
        self.size = 0  # tokens held
        self.stale = 0  # index entries of evicted documents
        self._next_id = 0

    def add(self, owner: str | None, tokens: list[int] = ()) -> int:
        """A new document of (at most max_tokens of the last of) `tokens`, evicting the least recently used
        ones past the bound; its id."""
        doc = self._next_id
        self._next_id += 1
        self.documents[doc] = Document(doc, owner)
        self.extend(doc, list(tokens)[-self.max_tokens :] if self.max_tokens else list(tokens))
        return doc

    def extend(self, doc: int, tokens: list[int]) -> None:
        text = self.documents[doc].tokens
        text.extend(tokens)
        self._index(doc, text, max(len(text) - len(tokens), KEY - 1) + 1)
        self.size += len(tokens)
        self.documents.move_to_end(doc)
        while self.max_tokens is not None and self.size > self.max_tokens:
            self._evict(next(iter(self.documents)))

    def _evict(self, doc: int) -> None:
        document = self.documents.pop(doc)
        self.size -= len(document.tokens)
        self.stale += max(len(document.tokens) - KEY + 1, 0)
        if self.stale > self.size:
            self.index.clear()
            for live in self.documents.values():
                self._index(live.id, live.tokens, KEY)
            self.stale = 0

    def _index(self, doc: int, text: list[int], first_end: int) -> None:
        """Index the bigrams of `text` (document `doc`) that end at first_end and after."""
        for end in range(first_end, len(text) + 1):
            self.index[tuple(text[end - KEY : end])].append((doc, end))

    def matches(self, context: list[int], owner: str | None, shared: bool, max_match: int
                ) -> tuple[int, list[tuple[Document, int]]]:
        """The longest match of a suffix of `context` (at most max_match tokens) and its occurrences, each as
        (document, position its continuation starts at), among the MAX_CANDIDATES most recent occurrences of
        its last KEY tokens. A document's own end is not an occurrence: nothing follows it yet."""
        if len(context) < KEY:
            return 0, []
        best, found, examined = 0, [], 0
        for doc, end in reversed(self.index.get(tuple(context[-KEY:]), ())):
            document = self.documents.get(doc)
            if document is None or end == len(document.tokens) or (not shared and document.owner != owner):
                continue
            text, length = document.tokens, KEY
            while length < min(max_match, end, len(context)) and text[end - length - 1] == context[-length - 1]:
                length += 1
            if length > best:
                best, found = length, [(document, end)]
            elif length == best:
                found.append((document, end))
            examined += 1
            if examined == MAX_CANDIDATES:
                break
        for document, _ in found:
            self.documents.move_to_end(document.id)
        return best, found


class SuffixDrafter(Drafter):
    """Trees of the continuations that followed each row's longest suffix match, in its own text and in
    earlier requests' outputs."""

    remembers_requests = True
    drafts_from_text = True  # its own memory holds committed tokens only: pending tokens join the match's context

    def __init__(self, max_tokens: int, shared: bool = False, factor: float = 1.0, min_probability: float = 0.1,
                 max_match: int = 32, max_nodes: int = 16, min_match: int = KEY, tokenizer=None):
        """min_match: a row whose longest match is shorter proposes nothing (the hybrid's min_n); tokenizer: the
        target's, for rows under a grammar to look their string values up in their prompts (None: they do not)."""
        if max_match < KEY:
            raise ValueError(f"suffix.max_match must be at least {KEY}, got {max_match}")
        self.min_match = min_match
        self.global_memory = TokenMemory(max_tokens)
        self.shared = shared
        self.factor, self.min_probability = factor, min_probability
        self.max_match, self.max_nodes = max_match, max_nodes
        self.rows: list[Sequence] = []  # the batch's sequences, in row order
        # Each sequence's own memory (one document), by id(seq): made at its first proposal, dropped with its row.
        self.own: dict[int, TokenMemory] = {}
        self.tokenizer = tokenizer
        # Rows under a grammar: their prompts as text, and without thousands separators, by id(seq).
        self.prompt_texts: dict[int, tuple[str, str]] = {}

    def add(self, seq: Sequence, features: torch.Tensor | None = None, row: BatchCache | None = None) -> None:
        self.rows.append(seq)

    def forget(self) -> None:
        self.global_memory = TokenMemory(self.global_memory.max_tokens)

    def remove(self, keep: list[int]) -> None:
        kept = set(keep)
        for i, seq in enumerate(self.rows):
            if i not in kept:
                self.own.pop(id(seq), None)
                self.prompt_texts.pop(id(seq), None)
                if seq.output_ids:  # gone: what it produced is memory for later requests
                    self.global_memory.add(seq.client, seq.output_ids)
        self.rows = [self.rows[i] for i in keep]

    def propose(self, seqs: list[Sequence], gamma: int, pending: list[list[int]] | None = None) -> Proposal:
        trees = [self._tree(seq, gamma, pending[i] if pending else []) for i, seq in enumerate(seqs)]
        width = max((len(tokens) for tokens, _ in trees), default=0)
        proposal_tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, (tokens, _) in enumerate(trees):
            proposal_tokens[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return Proposal(tokens=proposal_tokens, lengths=[len(tokens) for tokens, _ in trees], probs=None,
                        parents=[parents for _, parents in trees])

    def _tree(self, seq: Sequence, gamma: int, pending: list[int]) -> tuple[list[int], list[int]]:
        own = self.own.get(id(seq))
        if own is None:
            own = self.own[id(seq)] = TokenMemory()
            own.add(seq.client)
        text = own.documents[0].tokens
        own.extend(0, seq.tokens[len(text) :])  # catch up with what the last steps emitted
        context = seq.tokens + pending
        looks_up = seq.grammar is not None and self.tokenizer is not None
        written = self.tokenizer.decode(seq.output_ids + pending) if looks_up else None
        number = NUMBER_TAIL.search(written) if written is not None else None
        if number:  # the text's number goes on with its separators, where JSON's does not: look it up as digits
            tree = self._value_tree(self._texts(seq)[1], number.group(1), gamma)
            if tree[0]:
                return tree
        found = [own.matches(context, seq.client, True, self.max_match),
                 self.global_memory.matches(context, seq.client, self.shared, self.max_match)]
        length = max(match for match, _ in found)
        if not length or length < self.min_match:
            if written is None or '"' not in written:
                return [], []
            return self._value_tree(self._texts(seq)[0], written[written.rfind('"') + 1 :], gamma)
        continuations = [document.tokens[start : start + gamma]
                         for match, occurrences in found if match == length for document, start in occurrences]
        max_nodes = min(self.max_nodes, math.ceil(self.factor * length))
        return continuation_tree([c for c in continuations if c], max_nodes, self.min_probability)

    def _texts(self, seq: Sequence) -> tuple[str, str]:
        """A row's prompt as text, and without thousands separators."""
        if id(seq) not in self.prompt_texts:
            prompt = self.tokenizer.decode(seq.prompt_ids)
            self.prompt_texts[id(seq)] = (prompt, THOUSANDS.sub("", prompt))
        return self.prompt_texts[id(seq)]

    def _value_tree(self, text: str, value: str, gamma: int) -> tuple[list[int], list[int]]:
        """A tree of what followed, in `text` (the row's prompt), each occurrence of the JSON value being written:
        a string's text after its opening quote, or a number's digits (in the prompt without its thousands
        separators: the text's `68,000` is JSON's `68000`); none before a value's first character."""
        if not value:
            return [], []
        return continuation_tree(self._continuations(text, value, gamma), min(self.max_nodes, gamma),
                                 self.min_probability)

    def _continuations(self, text: str, value: str, gamma: int) -> list[list[int]]:
        """Up to gamma tokens of what follows each occurrence of `value` in `text`, the latest occurrences first,
        as the token memories take them: they win ties (a prompt's text to extract from usually comes after its
        instructions and schema)."""
        continuations, at = [], text.rfind(value)
        while at >= 0 and len(continuations) < MAX_CANDIDATES:
            after = text[at + len(value) : at + len(value) + VALUE_WINDOW]
            # The window's last token may be cut short: it is left out.
            tokens = self.tokenizer.encode(after, add_special_tokens=False)[:-1][:gamma]
            if tokens:
                continuations.append(tokens)
            at = text.rfind(value, 0, at + len(value) - 1)
        return continuations


def from_config(config: Config, target: ModelRunner, build: DrafterBuilder) -> SuffixDrafter:
    """The suffix drafter of speculation.suffix."""
    s = config.speculation.suffix
    return SuffixDrafter(s.max_tokens, s.shared, s.factor, s.min_probability, s.max_match, s.max_nodes,
                         tokenizer=target.tokenizer)
