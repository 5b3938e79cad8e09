"""Tiny random-weight models with a real (small, trained in-process) BPE tokenizer.

For tests and the no-download config: everything is built from a config in
memory, deterministically from a seed.
"""

from __future__ import annotations

import inspect
import json
import re

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from .attention import IMPLEMENTATION

TINY_PATTERN = re.compile(r"^tiny-random-(llama|qwen2)(?:@(\d+))?$")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 384


def is_tiny(name: str) -> bool:
    return TINY_PATTERN.match(name) is not None


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on Python's json module source: real merges, no download."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([inspect.getsource(json.decoder), inspect.getsource(json.encoder)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", bos_token="<|endoftext|>")
    fast.pad_token = "<|endoftext|>"
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model(name: str, vocab_size: int) -> torch.nn.Module:
    """A two-layer random model of the named family, seeded by the @seed suffix."""
    family, seed = TINY_PATTERN.match(name).groups()
    config = AutoConfig.for_model(
        family,
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(int(seed or 0))
    model = AutoModelForCausalLM.from_config(config, attn_implementation=IMPLEMENTATION)
    # Random init gives near-uniform outputs; sharpen them so decoding has structure worth predicting.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model
