"""Incremental detokenization and stop strings, against the tiny tokenizer (its byte tokens split characters)."""

import random

import pytest

from server.detokenize import IncrementalDetokenizer, TextOutput
from specdec_core.models.tiny import tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def random_ids(tokenizer, rng: random.Random, length: int) -> list[int]:
    """Random non-special ids: many are lone bytes of multi-byte characters."""
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    return [rng.choice(vocab) for _ in range(length)]


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def detokenize(tokenizer, prompt: list[int], output: list[int]) -> list[tuple[int, str]]:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [piece for token in output for piece in detok.add(token)]
    return pieces + detok.flush()


def test_pieces_concatenate_to_the_full_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(50):
        prompt, output = random_ids(tokenizer, rng, 4), random_ids(tokenizer, rng, 30)
        pieces = detokenize(tokenizer, prompt, output)
        assert [token for token, _ in pieces] == output  # one piece per token, in order
        assert "".join(text for _, text in pieces) == decode(tokenizer, output)


def test_a_character_split_over_tokens_belongs_to_the_token_completing_it(tokenizer):
    ids = tokenizer.encode("é€")
    assert len(ids) == 5  # the tiny vocabulary has no merges for these: one token per byte
    assert [text for _, text in detokenize(tokenizer, [], ids)] == ["", "é", "", "", "€"]


def test_an_invalid_byte_keeps_its_own_replacement_character(tokenizer):
    lead, letter = tokenizer.encode("é")[0], tokenizer.encode("a")[0]
    assert [text for _, text in detokenize(tokenizer, [], [lead, letter])] == ["\ufffd", "a"]


def released(output: TextOutput, ids: list[int]) -> list:
    pieces = []
    for token in ids:
        pieces += output.add(token)
        if output.stopped:
            return pieces
    return pieces + output.finish()


@pytest.mark.parametrize("seed", range(40))
def test_stop_strings_are_cut_across_token_boundaries(tokenizer, seed):
    rng = random.Random(seed)
    ids = random_ids(tokenizer, rng, 40)
    full = decode(tokenizer, ids)
    start = rng.randrange(1, len(full) - 4)
    stop = full[start : start + rng.randint(1, 4)]
    cut = full.find(stop)
    output = TextOutput(tokenizer, [], [stop, "never-appears"])
    pieces = released(output, ids)
    assert output.stopped
    assert output.text == "".join(p.text for p in pieces) == full[:cut]
    # Exactly the tokens needed for the text before the stop are kept, and counted.
    kept = next(k for k in range(len(ids) + 1) if decode(tokenizer, ids[:k]).startswith(full[:cut]))
    assert output.released == len(pieces) == kept
    assert [p.position for p in pieces] == list(range(kept))


def test_text_is_held_while_it_may_start_a_stop_string(tokenizer):
    a, b, c = (tokenizer.encode(ch)[0] for ch in "abc")
    output = TextOutput(tokenizer, [], ["ab"])
    assert output.add(a) == []  # "a" may begin "ab"
    pieces = output.add(c)  # "ac" cannot: both tokens go out, one piece each
    assert [(p.text, p.offset) for p in pieces] == [("a", 0), ("c", 1)]
    assert output.add(a) == [] and output.add(b) == []
    assert output.stopped and output.text == "ac" and output.released == 2


def test_without_stop_strings_everything_is_released(tokenizer):
    ids = tokenizer.encode("def f(x):\n    return x")
    output = TextOutput(tokenizer, [], [])
    assert "".join(p.text for p in released(output, ids)) == "def f(x):\n    return x"
    assert output.released == len(ids) and not output.stopped
