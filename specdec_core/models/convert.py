"""Converting a verified GGUF for transformers, once per model: its config and tokenizer, and on demand its weights
as bf16 safetensors (what float, int4 and int8 weights load; gguf weights read the GGUF file itself)."""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path
from unittest import mock


def convert_metadata(gguf_path: Path, out_dir: Path) -> None:
    """Save the GGUF's config, generation config and tokenizer (with its chat template) into ``out_dir``, no weights."""
    # Both loads read a local directory, so nothing should reach for a hub; HF_HUB_OFFLINE makes
    # sure of it when transformers is first imported here (huggingface_hub reads it at import).
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, modeling_gguf_pytorch_utils

    # The config and the tokenizer each parse the whole file (its 151,936-token vocabulary and merges: 8 s of the
    # 1.5B's 16 s); here it is parsed once, each caller getting its own copy of what it read.
    read = functools.cache(modeling_gguf_pytorch_utils.load_gguf_checkpoint)
    src, name = str(gguf_path.parent), gguf_path.name
    with mock.patch.object(modeling_gguf_pytorch_utils, "load_gguf_checkpoint",
                           lambda *args, **kwargs: copy.deepcopy(read(*args, **kwargs))):
        config = AutoConfig.from_pretrained(src, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)  # carries the chat template


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF with transformers and save bf16 safetensors, config and tokenizer into ``out_dir``."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    # dequantize=True asks for a plain dense model: transformers then drops the GGUF quantizer and
    # its quantization_config itself, so save_pretrained accepts the model. (Without it, 5.24 keeps
    # weights packed when the `kernels` package is installed, and refuses to save either way.)
    model = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)  # carries the chat template (chat_template.jinja)
