"""The static step's fused ops (step_ops.cpp): each computes transformers' numbers bit for bit, so the static
step on them is the step that calls the modules, on real weights, in prefills, decode and verify passes, with
a negative control that rounds where a naive fusion would and is caught."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from transformers.models.llama.modeling_llama import rotate_half

from specdec_core.models import step_ops
from specdec_core.models.runner import ModelRunner
from specdec_core.models.static_runner import StaticRunner

from .helpers import single_thread  # noqa: F401  (autouse: torch on one thread)
from .test_static_step import smollm2_int4  # noqa: F401  (the fixture: SmolLM2 with int4 weights)

needs_ops = pytest.mark.skipif(step_ops.extension() is None, reason="the fused ops could not be built here")


def passes(runner: ModelRunner) -> list[torch.Tensor]:
    """Logits, hidden states and the cache after a 40-token prefill of 2 rows, then passes of 1, 8 and 3 tokens."""
    static = StaticRunner.of(runner, compiled=False)
    generator = torch.Generator().manual_seed(0)
    cache = static.new_cache()
    out = []
    for k, row_invariant in ((40, False), (1, True), (8, True), (3, True)):
        logits, hidden = static.forward(cache, torch.randint(0, 1000, (2, k), generator=generator), hidden_states=True,
                                        row_invariant=row_invariant)
        cache.commit(torch.ones(2, k, dtype=torch.bool))
        out += [logits, *hidden]
    return out + cache.keys + cache.values


def rounded_once(q, k, v, cos, sin, keys, values, slots):
    """rotate_and_cache as a naive fusion would do it: the rotation in float32, rounded once at the end."""
    batch, tokens, _ = q.shape
    dim = cos.shape[-1]
    rows = torch.arange(batch)[:, None]

    def rotate(x):
        x = x.reshape(batch, tokens, -1, dim).float()
        return (x * cos[:, :, None].float() + rotate_half(x) * sin[:, :, None].float()).to(q.dtype)

    keys[rows, :, slots] = rotate(k)
    values[rows, :, slots] = v.reshape(batch, tokens, -1, dim)
    return rotate(q).transpose(1, 2)


@needs_ops
def test_the_fused_ops_compute_the_modules_numbers_bit_for_bit(smollm2_int4):  # noqa: F811
    fused = passes(smollm2_int4)
    with mock.patch.object(step_ops, "for_pass", lambda hidden: None):
        modules = passes(smollm2_int4)
    assert len(fused) == len(modules) and all(torch.equal(a, b) for a, b in zip(fused, modules))

    class NaiveOps:  # the negative control: the same ops, the rotation rounded once
        add_rms_norm = staticmethod(step_ops.extension().add_rms_norm)
        rotate_and_cache = staticmethod(rounded_once)

    with mock.patch.object(step_ops, "for_pass", lambda hidden: NaiveOps):
        naive = passes(smollm2_int4)
    assert not all(torch.equal(a, b) for a, b in zip(naive, modules))


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_residual_norm_is_the_modules_with_and_without_a_delta(dtype):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    torch.manual_seed(1)
    norm = Qwen2RMSNorm(96, eps=1e-6).to(dtype)
    norm.weight.data.normal_()
    hidden, delta = torch.randn(2, 5, 96, dtype=dtype), torch.randn(2, 5, 96, dtype=dtype)
    summed, normed = step_ops.extension().add_rms_norm(hidden, delta, norm.weight, norm.variance_epsilon)
    assert torch.equal(summed, hidden + delta) and torch.equal(normed, norm(hidden + delta))
    same, normed = step_ops.extension().add_rms_norm(hidden, None, norm.weight, norm.variance_epsilon)
    assert same is hidden or torch.equal(same, hidden)
    assert torch.equal(normed, norm(hidden))


@needs_ops
def test_a_slot_outside_the_cache_is_refused():
    q = k = v = torch.zeros(1, 1, 8)
    cos = sin = torch.zeros(1, 1, 8)
    keys = values = torch.zeros(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="slot 4 lies outside the cache's 4"):
        step_ops.extension().rotate_and_cache(q, k, v, cos, sin, keys, values, torch.tensor([[4]]))
