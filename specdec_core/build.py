"""Compose an engine from a config: load the target, the drafter and the controller."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from torch import nn

from .config import DRAFTERS, MODEL_DRAFTERS, Config, ModelConfig
from .control import Controller
from .drafters.base import Drafter
from .drafters.distilled import (
    AdaptedOutput,
    DistilledDrafter,
    DistilledDraftModelDrafter,
    default_student_name,
    load_student,
)
from .drafters.draft_model import DraftModelDrafter
from .drafters.eagle import EagleDrafter
from .drafters.hybrid import HybridDrafter
from .drafters.layer_skip import LayerSkipDrafter, default_k
from .drafters.medusa import MedusaDrafter
from .drafters.ngram import NgramDrafter
from .drafters.quantized import QuantizedDrafter, quantized_copy
from .engine import Engine
from .models.catalogue import REGISTRY
from .models.eagle_net import load_eagle
from .models.medusa_heads import default_heads_name, load_heads
from .models.paths import model_dir
from .models.quant import DEFAULT_GROUP_SIZE, QUANTIZED, cache_file, quantize_model
from .models.runner import DTYPES, ModelRunner, load_model, resolve_device, set_threads
from .models.tiny import is_tiny, tiny_model, tiny_tokenizer
from .models.vocab import ReducedVocab, reduced_vocab

log = logging.getLogger("specdec")


class TokenizerMismatch(ValueError):
    """The drafter's tokenizer differs from the target's."""


def load_runner(name: str, model: ModelConfig) -> ModelRunner:
    """A runner for a registry name (pulled when missing), a local directory, a hub id, or a tiny random model,
    its linear layers quantized when `model.weights` asks for it."""
    runner = _load_float_runner(name, model)
    if model.weights in QUANTIZED:
        # Only registry models' directories are ours to write into; others are quantized on every start.
        directory = registry_dir(name)
        cache = cache_file(directory, model.weights, DEFAULT_GROUP_SIZE, runner.device) if directory else None
        # After ModelRunner(): it reads the vocabulary size from the float output layer's weight.
        quantize_model(runner.model, model.weights, DEFAULT_GROUP_SIZE, cache)
    return runner


def _load_float_runner(name: str, model: ModelConfig) -> ModelRunner:
    set_threads(model.threads)
    if is_tiny(name):
        tokenizer = tiny_tokenizer()
        module = tiny_model(name, len(tokenizer)).to(DTYPES[model.dtype]).to(resolve_device(model.device)).eval()
        return ModelRunner(module, tokenizer, name)
    from .models.registry import resolve

    module, tokenizer = load_model(resolve(name), model.dtype, model.device)
    return ModelRunner(module, tokenizer, name)


def tokenizer_fingerprint(tokenizer) -> dict:
    """What must agree for two models to share token ids: vocabulary, merges and special tokens."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    return {
        "vocab": tokenizer.get_vocab(),
        "merges": state["model"].get("merges"),
        "special": {k: str(v) for k, v in tokenizer.special_tokens_map.items()},
    }


def check_same_tokenizer(target: ModelRunner, draft: ModelRunner) -> None:
    """Refuse a drafter whose tokenizer differs from the target's, naming both models."""
    mine, theirs = tokenizer_fingerprint(target.tokenizer), tokenizer_fingerprint(draft.tokenizer)
    differing = [part for part in mine if mine[part] != theirs[part]]
    if differing:
        raise TokenizerMismatch(
            f"draft model {draft.name!r} does not share the tokenizer of target {target.name!r} "
            f"(they differ in: {', '.join(differing)}); pick a draft model of the same family"
        )


def registry_dir(name: str) -> Path | None:
    """A registry model's own cache directory (ours to write derived files into); None for other models."""
    return model_dir(name) if name in REGISTRY else None


def _reducible(vocab: ReducedVocab | None, model: nn.Module) -> ReducedVocab | None:
    """`vocab` if `model`'s output layer can be cut to it (a float nn.Linear), else None, logged."""
    if vocab is not None and not isinstance(model.get_output_embeddings(), nn.Linear):
        log.warning("speculation.vocab_size: the output layer is quantized; drafting over the full vocabulary")
        return None
    return vocab


def build_drafter(config: Config, target: ModelRunner, drafter: str | None = None) -> Drafter | None:
    spec = config.speculation
    name = drafter or spec.drafter
    if name == "none":
        return None
    if name == "ngram":
        return NgramDrafter(spec.ngram.min_n, spec.ngram.max_n, spec.ngram.max_len)
    if name == "hybrid":
        ngram = NgramDrafter(spec.hybrid.min_n, max(spec.hybrid.min_n, spec.ngram.max_n), spec.ngram.max_len)
        return HybridDrafter(ngram, build_drafter(config, target, spec.hybrid.drafter))
    if name == "medusa":
        return medusa_drafter(config, target)
    if name == "eagle":
        return eagle_drafter(config, target)
    if name == "distilled":
        return distilled_drafter(config, target)
    if name not in MODEL_DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")
    cache_dir = registry_dir(config.model.target)
    vocab = reduced_vocab(target.tokenizer, target.vocab_size, spec.vocab_size, cache_dir)
    if name == "layer-skip":
        k = spec.layer_skip.k or default_k(target.num_layers)
        return LayerSkipDrafter(target, k, _reducible(vocab, target.model), spec.early_exit)
    if name == "quantized":
        draft = quantized_copy(target, spec.quantized.weights, vocab, cache_dir)
        return QuantizedDrafter(draft, target.vocab_size, vocab, spec.early_exit)
    if not spec.draft_model:
        raise ValueError("drafter draft-model needs speculation.draft_model in the config")
    draft, vocab = draft_runner(config, target, spec.draft_model, vocab)
    return DraftModelDrafter(draft, target.vocab_size, vocab, spec.early_exit)


def draft_runner(config: Config, target: ModelRunner, name: str, vocab: ReducedVocab | None
                 ) -> tuple[ModelRunner, ReducedVocab | None]:
    """The draft model `name` for `target`, its output layer cut to `vocab` when it can be, and the vocabulary it got."""
    draft = load_runner(name, config.model)
    check_same_tokenizer(target, draft)
    vocab = _reducible(vocab, draft.model)
    if vocab is not None:
        vocab.reduce_output(draft.model)
    return draft, vocab


def medusa_drafter(config: Config, target: ModelRunner) -> MedusaDrafter:
    """The config's trained Medusa heads over `target`; heads not trained yet raise MissingHeadsError,
    which names the command that trains them."""
    settings = config.speculation.medusa
    heads, _, vocab = load_heads(settings.heads or default_heads_name(config.model.target), config.model.target)
    return MedusaDrafter(target, heads, _reducible(vocab, target.model), settings.tree_nodes, settings.top_k)


def eagle_drafter(config: Config, target: ModelRunner) -> EagleDrafter:
    """The config's trained EAGLE network over `target`; weights not trained yet raise MissingEagleError,
    which names the command that trains them."""
    settings = config.speculation.eagle
    net = load_eagle(settings.weights or f"{config.model.target}-eagle", target.model, config.model.target)
    return EagleDrafter(net, settings.top_k, settings.depth, settings.total_tokens)


def distilled_drafter(config: Config, target: ModelRunner) -> DistilledDrafter | DistilledDraftModelDrafter:
    """The config's distilled student over `target`; one not trained yet raises MissingStudentError,
    which names the command that trains it."""
    spec = config.speculation
    adapter, meta, vocab = load_student(spec.distilled.student or default_student_name(config.model.target), config.model.target)
    student = meta["student"]
    if student["kind"] == "layer-skip":
        return DistilledDrafter(target, adapter, student["k"], _reducible(vocab, target.model), spec.early_exit)
    draft, vocab = draft_runner(config, target, student["model"], vocab)
    draft.model.set_output_embeddings(AdaptedOutput(adapter.to(draft.device), draft.model.get_output_embeddings()))
    return DistilledDraftModelDrafter(draft, target.vocab_size, vocab, spec.early_exit)


def eos_ids(runner: ModelRunner) -> set[int]:
    """End-of-sequence ids from the tokenizer and the generation config."""
    ids = {runner.tokenizer.eos_token_id}
    generation = getattr(runner.model, "generation_config", None)
    extra = getattr(generation, "eos_token_id", None) if generation else None
    ids.update(extra if isinstance(extra, list) else [extra])
    return {i for i in ids if i is not None}


def build_engine(config: Config, drafter: str | None = None, target: ModelRunner | None = None) -> Engine:
    """The engine a config describes; `drafter` overrides the config's; `target` reuses a loaded target."""
    target = target or load_runner(config.model.target, config.model)
    spec = config.speculation
    controller = Controller(gamma_max=spec.gamma_max, fixed_gamma=spec.gamma, max_speculative_batch=spec.max_speculative_batch)
    return Engine(target, build_drafter(config, target, drafter), controller, eos_ids(target))
