"""A weight-only int8 or int4 copy of the target drafts for the full-precision target.

Decoding streams every weight per token, so a copy with 1-byte (int8) or
half-byte (int4) weights costs a fraction of a bf16 pass while predicting
almost exactly what the target predicts. The copy shares every tensor with
the target except the linear layers that `models/quant.py` replaces with
packed ones: embeddings, norms and rotary tables are not duplicated, and the
float weights are read once to pack and never copied. It keeps its own KV
cache (its keys differ from the target's), so it drafts as a draft model
does: a `DraftModelDrafter` over the copy.
"""

from __future__ import annotations

import copy
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from ..models.loading import registry_dir, target_vocab
from ..models.quant import DEFAULT_GROUP_SIZE, cache_file, quantize_model
from ..models.runner import ModelRunner
from ..models.vocab import ReducedVocab
from .base import DrafterBuilder
from .draft_model import DraftModelDrafter

if TYPE_CHECKING:
    from ..config import Config


def quantized_copy(target: ModelRunner, weights: str, vocab: ReducedVocab | None, cache_dir: Path | None) -> ModelRunner:
    """The target with its linear layers quantized to `weights` (and its output layer cut to `vocab`), sharing the rest."""
    if not any(isinstance(m, nn.Linear) for m in target.model.modules()):
        raise ValueError("drafter quantized needs a float target: set model.weights to null")
    # A deep copy of the module tree whose memo maps every tensor to itself: new modules, the same tensors.
    tensors = chain(target.model.parameters(), target.model.buffers())
    model = copy.deepcopy(target.model, memo={id(t): t for t in tensors})
    if vocab is not None:
        vocab.reduce_output(model)
    runner = ModelRunner(model, target.tokenizer, f"{target.name}@{weights}")
    cache = None
    if cache_dir is not None:
        cache = cache_file(cache_dir, weights, DEFAULT_GROUP_SIZE, runner.device)
        if vocab is not None:  # its own file: packed weights of another output layer must not replace the target's
            cache = cache.with_name(f"vocab{vocab.size}-{cache.name}")
    quantize_model(model, weights, DEFAULT_GROUP_SIZE, cache)
    return runner


def from_config(config: Config, target: ModelRunner, build: DrafterBuilder) -> DraftModelDrafter:
    """`target`'s copy quantized to speculation.quantized.weights, drafting as a draft model."""
    spec = config.speculation
    vocab = target_vocab(target, spec.vocab_size)
    draft = quantized_copy(target, spec.quantized.weights, vocab, registry_dir(target.name))
    return DraftModelDrafter(draft, target.vocab_size, vocab, spec.early_exit)
