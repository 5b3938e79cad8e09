"""Reduced vocabulary for drafters that own an output layer (as EAGLE-3 does).

A drafter predicts over the N tokens its target's tokenizer produces most
often, so its output layer is N rows instead of V (151,936 in the Qwen
models, where the output layer is a large share of a small pass). q is zero
outside that set, so verification against the target's full vocabulary stays
exact: a token the draft cannot propose is still emitted whenever the target
draws it (as the replacement after a rejection, or as the bonus token).

Frequencies are counted with the target's own tokenizer over text every
Python install carries offline: the standard library's sources and its
documentation (pydoc's topics). The Spec-Bench prompts are left out on
purpose: the benchmark must not tune the drafter. Counts of registry models
are cached in the model's directory.
"""

from __future__ import annotations

import logging
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .quant import QuantLinear

log = logging.getLogger("specdec")

CORPUS_BYTES = 8 * 2**20  # about 8 s of tokenizing on this CPU, once per model
COUNTS_FILE = "token-counts-stdlib.safetensors"


def corpus(max_bytes: int = CORPUS_BYTES) -> Iterator[str]:
    """pydoc's documentation topics, then the standard library's top-level modules in name order."""
    from pydoc_data.topics import topics

    budget = max_bytes
    texts = list(topics.values())
    texts += (path.read_text(errors="replace") for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")))
    for text in texts:
        if budget <= 0:
            return
        yield text[:budget]
        budget -= len(text)


def count_tokens(tokenizer, texts: Iterator[str], vocab: int) -> torch.Tensor:
    """How often each of `vocab` token ids occurs in the tokenized texts: [vocab] int64."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for encoding in tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False):
        counts += torch.bincount(torch.tensor(encoding.ids, dtype=torch.long), minlength=vocab)[:vocab]
    return counts


def token_counts(tokenizer, vocab: int, cache_dir: Path | None) -> torch.Tensor:
    """Token frequencies over the corpus, read from (or saved to) `cache_dir` when given."""
    path = cache_dir / COUNTS_FILE if cache_dir else None
    if path and path.is_file():
        counts = load_file(str(path))["counts"]
        if counts.shape == (vocab,):
            return counts
    counts = count_tokens(tokenizer, corpus(), vocab)
    if path:
        tmp = path.with_name(f"{path.name}.partial")
        save_file({"counts": counts}, str(tmp))
        tmp.replace(path)  # renamed into place: a reader never sees half a file
    return counts


@dataclass
class ReducedVocab:
    """The token ids a drafter predicts over, and how to map its logits back to the full vocabulary."""

    ids: torch.Tensor  # [N] long, ascending
    full_size: int  # V, the target's vocabulary

    @classmethod
    def most_frequent(cls, counts: torch.Tensor, size: int, always: set[int]) -> ReducedVocab:
        """The `size` most frequent ids, `always` among them (special tokens: without EOS a draft could never end)."""
        priority = counts.clone()
        priority[sorted(always)] = counts.max() + 1
        # Stable sort: ties keep id order, so the set is the same on every run.
        chosen = torch.sort(priority, descending=True, stable=True).indices[:size]
        return cls(chosen.sort().values, len(counts))

    @property
    def size(self) -> int:
        return len(self.ids)

    def head(self, output: nn.Module) -> nn.Linear:
        """A float copy of the rows of `output` (an nn.Linear, or a quantized one: its rows dequantized)
        for these tokens."""
        if isinstance(output, QuantLinear):
            weight = output.dequantize()
        elif isinstance(output, nn.Linear):
            weight = output.weight.detach()
        else:
            raise TypeError(f"a reduced vocabulary slices a linear output layer, not {type(output).__name__}")
        head = nn.Linear(weight.shape[1], self.size, bias=output.bias is not None, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            head.weight.copy_(weight[self.ids.to(weight.device)])
            if output.bias is not None:
                head.bias.copy_(output.bias[self.ids.to(weight.device)])
        return head.requires_grad_(False)

    def reduce_output(self, model: nn.Module) -> None:
        """Replace `model`'s own output layer by its rows for these tokens (a draft model that only drafts)."""
        model.set_output_embeddings(self.head(model.get_output_embeddings()))

    def expand(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [..., N] over the reduced vocabulary as [..., V], -inf outside it (q is zero there)."""
        full = logits.new_full((*logits.shape[:-1], self.full_size), float("-inf"))
        full[..., self.ids.to(logits.device)] = logits
        return full


def reduced_vocab(tokenizer, vocab: int, size: int | None, cache_dir: Path | None) -> ReducedVocab | None:
    """The `size` most frequent tokens of `tokenizer` (a vocabulary of `vocab`), or None when that is all of them."""
    if size is None or size >= vocab:
        return None
    always = {i for i in tokenizer.all_special_ids if i is not None and i < vocab}
    return ReducedVocab.most_frequent(token_counts(tokenizer, vocab, cache_dir), size, always)
