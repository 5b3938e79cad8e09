"""Token ids to text, one token at a time: whole UTF-8 characters only, stop strings cut out.

`IncrementalDetokenizer` turns each new token into the text it adds, holding
back tokens that end inside a multi-byte character. `TextOutput` sits on top:
it matches stop strings across token boundaries and releases a token only once
its text can no longer turn out to be the start of a stop string, so nothing at
or after a stop ever reaches a client (text, logprobs or token counts).
"""

from __future__ import annotations

import os
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import accumulate

# Prompt tokens decoded ahead of the output, so the first output token decodes
# as it would inside the full text (some tokenizers strip a leading space).
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Decodes a growing output a token at a time (the windowed scheme of TGI and vLLM)."""

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        if self._decode(self.ids).endswith("\ufffd"):
            self.ids = []  # a prompt ending inside a character would swallow the output's first bytes
        self.prefix = 0  # window start: already-decoded tokens kept as context
        self.read = len(self.ids)  # tokens up to here have their text

    def add(self, token_id: int) -> list[tuple[int, str]]:
        """(token, text) of each token that got its text with this one, oldest first; [] while a character is unfinished."""
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> list[tuple[int, str]]:
        """The tokens still held back, with U+FFFD for bytes that never formed a character."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[tuple[int, str]]:
        before = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if not final and (len(text) <= len(before) or text.endswith("\ufffd")):
            return []
        # Each token owns what it adds to the text the tokens before it had fixed: a character
        # split over tokens belongs to the token completing it, an invalid byte to its own token.
        pieces, fixed = [], len(before)
        for end in range(self.read + 1, len(self.ids) + 1):
            partial = self._decode(self.ids[self.prefix : end]) if end < len(self.ids) else text
            stable = max(len(os.path.commonprefix([partial, text])), fixed)
            pieces.append((self.ids[end - 1], text[fixed:stable]))
            fixed = stable
        self.prefix, self.read = self.read, len(self.ids)
        return pieces

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@dataclass
class Piece:
    """One output token as released to the client."""

    position: int  # index in the sequence's output_ids (and token_logprobs)
    token_id: int
    text: str
    offset: int  # where `text` starts in the released output text


class TextOutput:
    """One choice's output text: tokens go in, released pieces come out, stop strings never do."""

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str]):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stop = [s for s in stop if s]
        self.text = ""  # released so far
        self.released = 0  # tokens released so far: the choice's completion_tokens
        self.stopped = False
        self._held: list[tuple[int, str]] = []  # (token_id, text) with text, not yet released

    def add(self, token_id: int) -> list[Piece]:
        """Feed the next output token; returns the pieces that became safe to send."""
        if self.stopped:
            return []
        self._held += self.detokenizer.add(token_id)
        return self._release(final=False)

    def finish(self) -> list[Piece]:
        """The sequence ended: release everything held (unless it completes a stop string)."""
        if self.stopped:
            return []
        self._held += self.detokenizer.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> list[Piece]:
        pending = "".join(text for _, text in self._held)
        ends = list(accumulate(len(text) for _, text in self._held))
        starts = [0, *ends[:-1]]
        hit = min((i for i in (pending.find(s) for s in self.stop) if i >= 0), default=-1)
        if hit >= 0:
            # Keep the tokens whose text starts before the stop string; the rest never happened.
            self.stopped = True
            return self._emit(bisect_left(starts, hit), cut=hit, starts=starts)
        # Hold back the longest tail that could still grow into a stop string: whole tokens
        # before it go out, and an empty token at its edge (a character's first bytes) stays.
        safe = len(pending) if final else len(pending) - self._stop_prefix_len(pending)
        count = len(self._held) if safe == len(pending) else min(bisect_right(ends, safe), bisect_left(starts, safe))
        return self._emit(count, cut=safe, starts=starts)

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _emit(self, count: int, cut: int, starts: list[int]) -> list[Piece]:
        """Release the first `count` held tokens, their text cut off at `cut` (an offset into the held text)."""
        pieces = []
        for i, ((token_id, text), start) in enumerate(zip(self._held[:count], starts)):
            piece = Piece(self.released + i, token_id, text[: max(cut - start, 0)], len(self.text))
            self.text += piece.text
            pieces.append(piece)
        del self._held[:count]
        self.released += count
        return pieces
