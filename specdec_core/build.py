"""Compose an engine from a config: load the target, the drafter and the controller."""

from __future__ import annotations

import json
import logging

from .config import Config, ModelConfig
from .control import Controller
from .drafters.base import Drafter
from .drafters.draft_model import DraftModelDrafter
from .drafters.ngram import NgramDrafter
from .engine import Engine
from .models.runner import DTYPES, ModelRunner, load_model, resolve_device, set_threads
from .models.tiny import is_tiny, tiny_model, tiny_tokenizer

log = logging.getLogger("specdec")


class TokenizerMismatch(ValueError):
    """The drafter's tokenizer differs from the target's."""


def load_runner(name: str, model: ModelConfig) -> ModelRunner:
    """A runner for a registry name (pulled when missing), a local directory, a hub id, or a tiny random model."""
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


def build_drafter(config: Config, target: ModelRunner, drafter: str | None = None) -> Drafter | None:
    spec = config.speculation
    name = drafter or spec.drafter
    if name == "none":
        return None
    if name == "ngram":
        return NgramDrafter(spec.ngram.min_n, spec.ngram.max_n, spec.ngram.max_len)
    if name == "draft-model":
        if not spec.draft_model:
            raise ValueError("drafter draft-model needs speculation.draft_model in the config")
        draft = load_runner(spec.draft_model, config.model)
        check_same_tokenizer(target, draft)
        return DraftModelDrafter(draft, target.vocab_size)
    raise ValueError(f"unknown drafter {name!r}; choose one of none, ngram, draft-model")


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
