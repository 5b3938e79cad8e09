"""Helpers shared by the model, engine and exactness tests."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest
import torch

from specdec_core.engine import Engine
from specdec_core.models.runner import ModelRunner
from specdec_core.models.tiny import tiny_model
from specdec_core.sequence import Sequence


@pytest.fixture(autouse=True, scope="module")
def single_thread() -> Iterator[None]:
    """Torch on one intra-op thread for a test module (import this fixture to use it).

    These tests' tensors are small, and on a shared two-core host torch's
    thread pool turns a microsecond op into milliseconds of spin-waiting.
    """
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def tiny_runner(seed: int = 0, vocab: int = 64, family: str = "llama", tokenizer=None) -> ModelRunner:
    """A two-layer random model (see models/tiny.py) in fp32 on the CPU."""
    name = f"tiny-random-{family}@{seed}"
    return ModelRunner(tiny_model(name, vocab).eval(), tokenizer, name)


@torch.no_grad()
def full_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """Logits [len, V] of one plain forward over `tokens`, no cache: the reference for everything cached."""
    return runner.model(input_ids=torch.tensor([tokens], device=runner.device)).logits[0].float()


def greedy_reference(runner: ModelRunner, prompt: list[int], max_tokens: int, eos: set[int] = frozenset()) -> list[int]:
    """Plain greedy decoding by full forwards: independent of the cache, the engine and the drafters."""
    out: list[int] = []
    while len(out) < max_tokens and not (out and out[-1] in eos):
        out.append(int(full_logits(runner, prompt + out)[-1].argmax()))
    return out


def decode(engine: Engine, seqs: list[Sequence], joins: dict[int, list[Sequence]] | None = None) -> list:
    """Add `seqs`, then step until every sequence is done; joins[k] join before step k. Returns the step reports."""
    for seq in seqs:
        engine.add(seq)
    joins = dict(joins or {})
    reports = []
    while engine.seqs or joins:
        for seq in joins.pop(len(reports), []):
            engine.add(seq)
        assert engine.seqs, f"the batch emptied before the joins at steps {sorted(joins)}"
        reports.append(engine.step())
    return reports


# Per GGUF type: inputs per block, bytes per block, and the offsets of its float16 fields (d, and dmin or m).
GGUF_BLOCKS = {"Q4_K": (256, 144, (0, 2)), "Q6_K": (256, 210, (208,)), "Q4_1": (32, 20, (0, 2)), "Q5_0": (32, 22, (0,)),
               "Q8_0": (32, 34, (0,))}


def gguf_tensor(qtype: str, rows: int, inputs: int, seed: int, scale: float = 0.01) -> np.ndarray:
    """A GGUF tensor's bytes [rows, bytes per row] of type `qtype`: random bytes, so every bit pattern of codes and
    sub-scales occurs, with float16 fields of either sign about `scale` in size (the file's d, dmin, m)."""
    size, block_bytes, halves = GGUF_BLOCKS[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, inputs // size, block_bytes), dtype=np.uint8)
    for at in halves:
        values = (rng.standard_normal((rows, inputs // size)) * scale).astype(np.float16)
        blocks[..., at:at + 2] = values[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)
