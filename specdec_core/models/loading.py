"""Loading the models a config names: the target, a draft model of its family, and what their files say
(tokenizer, end-of-sequence ids, the reduced vocabulary a config asks for)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from . import attention
from .catalogue import REGISTRY
from .gguf_blocks import GgufFile
from .paths import gguf_path, model_dir
from .quant import DEFAULT_GROUP_SIZE, GGUF, QUANTIZED, cache_file, quantize_model
from .runner import DTYPES, ModelRunner, load_model, resolve_device, set_threads
from .static_runner import on_step
from .tiny import is_tiny, tiny_model, tiny_tokenizer
from .vocab import ReducedVocab, reduced_vocab

if TYPE_CHECKING:
    from ..config import ModelConfig

log = logging.getLogger("specdec")


class TokenizerMismatch(ValueError):
    """The drafter's tokenizer differs from the target's."""


def load_runner(name: str, model: ModelConfig) -> ModelRunner:
    """A runner for a registry name (pulled when missing), a local directory, a hub id, or a tiny random model,
    its linear layers quantized when `model.weights` asks for it."""
    if model.weights == GGUF and name not in REGISTRY:
        raise ValueError(f"model.weights: gguf serves a registry model's GGUF file; {name!r} is not one (see `specdec "
                         "models`): use weights: int4 or int8")
    runner = _load_float_runner(name, model)  # gguf weights: the file's layers already (_gguf_runner)
    if model.weights in QUANTIZED:
        # Only registry models' directories are ours to write into; others are quantized on every start.
        directory = registry_dir(name)
        cache = cache_file(directory, model.weights, DEFAULT_GROUP_SIZE, runner.device) if directory else None
        # After ModelRunner(): it reads the vocabulary size from the float output layer's weight.
        quantize_model(runner.model, model.weights, DEFAULT_GROUP_SIZE, cache)
    # Each output row of the quantized CPU kernels is its own dot products; float GEMMs block by the row count.
    quantized = runner.device.type == "cpu" and not any(isinstance(m, nn.Linear) for m in runner.model.modules())
    runner.row_invariant = quantized and attention.takes(runner.model.config, runner.dtype) and attention.extension() is not None
    return on_step(runner, model.step)


def _load_float_runner(name: str, model: ModelConfig) -> ModelRunner:
    set_threads(model.threads)
    if model.weights == GGUF:
        return _gguf_runner(name, model)
    if is_tiny(name):
        tokenizer = tiny_tokenizer()
        module = tiny_model(name, len(tokenizer)).to(DTYPES[model.dtype]).to(resolve_device(model.device)).eval()
        return ModelRunner(module, tokenizer, name)
    from .registry import resolve

    module, tokenizer = load_model(resolve(name), model.dtype, model.device)
    return ModelRunner(module, tokenizer, name)


def _gguf_runner(name: str, model: ModelConfig) -> ModelRunner:
    """A registry model served from its GGUF file's own blocks, with no float copy of its weights made or read: the
    config and tokenizer from the pull, the model built empty (on the meta device), its linear layers the file's
    blocks (quantize_model, cached packed), its embeddings the file's rows (GgufEmbedding), its other tensors (norms,
    biases) the file's values in `model.dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from .registry import pull

    if resolve_device(model.device).type != "cpu":
        raise ValueError("model.weights: gguf runs on our CPU kernel; on a GPU use weights: int4 (configs/default-bf16.yaml)")
    directory, dtype = pull(name, float_weights=False), DTYPES[model.dtype]
    gguf = GgufFile(gguf_path(REGISTRY[name].gguf_file))
    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=dtype,
                                                  attn_implementation=attention.IMPLEMENTATION)
    module.generation_config = GenerationConfig.from_pretrained(directory)
    quantize_model(module, GGUF, DEFAULT_GROUP_SIZE, cache_file(directory, GGUF, DEFAULT_GROUP_SIZE, torch.device("cpu")), gguf=gguf)
    module.set_input_embeddings(gguf.embedding(dtype))
    decoder = module.get_decoder()
    decoder.rotary_emb = type(decoder.rotary_emb)(config=module.config)  # its buffers, made on the meta device
    tied = bool(module.config.tie_word_embeddings)
    for tensor_name, tensor in [*module.named_parameters(), *module.named_buffers()]:  # norms, biases (buffers on the kernel)
        if tensor.is_meta and (values := gguf.values(tensor_name, tied)) is not None:
            owner, _, attribute = tensor_name.rpartition(".")
            values = values.to(dtype)
            setattr(module.get_submodule(owner), attribute, nn.Parameter(values, requires_grad=False)
                    if isinstance(tensor, nn.Parameter) else values)
    left = [name for name, tensor in [*module.named_parameters(), *module.named_buffers()] if tensor.is_meta]
    if left:
        raise LookupError(f"{name}: {', '.join(left)} not loaded from {gguf.path.name}")
    return ModelRunner(module.eval(), AutoTokenizer.from_pretrained(directory), name)


def registry_dir(name: str) -> Path | None:
    """A registry model's own cache directory (ours to write derived files into); None for other models."""
    return model_dir(name) if name in REGISTRY else None


def target_vocab(target: ModelRunner, size: int | None) -> ReducedVocab | None:
    """The target's `size` most frequent tokens (counts cached with a registry model); None: the full vocabulary."""
    return reduced_vocab(target.tokenizer, target.vocab_size, size, registry_dir(target.name))


def reducible(vocab: ReducedVocab | None, model: nn.Module) -> ReducedVocab | None:
    """`vocab` if `model`'s output layer can be cut to it (a float nn.Linear), else None, logged."""
    if vocab is not None and not isinstance(model.get_output_embeddings(), nn.Linear):
        log.warning("speculation.vocab_size: the output layer is quantized; drafting over the full vocabulary")
        return None
    return vocab


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


def draft_runner(model: ModelConfig, target: ModelRunner, name: str, vocab: ReducedVocab | None
                 ) -> tuple[ModelRunner, ReducedVocab | None]:
    """The draft model `name` for `target`, loaded as `model` says, its output layer cut to `vocab` when it can be,
    and the vocabulary it got."""
    draft = load_runner(name, model)
    check_same_tokenizer(target, draft)
    vocab = reducible(vocab, draft.model)
    if vocab is not None:
        vocab.reduce_output(draft.model)
    return draft, vocab


def eos_ids(runner: ModelRunner) -> set[int]:
    """End-of-sequence ids from the tokenizer and the generation config (a model of random weights has no tokenizer)."""
    ids = {runner.tokenizer.eos_token_id} if runner.tokenizer is not None else set()
    generation = getattr(runner.model, "generation_config", None)
    extra = getattr(generation, "eos_token_id", None) if generation else None
    ids.update(extra if isinstance(extra, list) else [extra])
    return {i for i in ids if i is not None}
