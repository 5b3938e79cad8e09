"""The static step's fused ops and KernelLayers (step_ops.h): each computes transformers' numbers bit for bit,
so the static step on them is the step that calls the modules, on real weights and on a model with biases,
float32 and bf16, in prefills, decode and verify passes, with negative controls that round where a naive fusion
would, or change a layer's output by a bit, and are caught."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from transformers.models.llama.modeling_llama import rotate_half

from specdec_core.config import ModelConfig
from specdec_core.models import step_ops, vnni
from specdec_core.models.loading import load_runner
from specdec_core.models.runner import ModelRunner
from specdec_core.models.static_runner import StaticRunner

from .helpers import single_thread  # noqa: F401  (autouse: torch on one thread)
from .test_quant import kernel_family  # noqa: F401  (the fixture: each kernel family this CPU runs)
from .test_static_step import smollm2_int4  # noqa: F401  (the fixture: SmolLM2 with int4 weights)

needs_ops = pytest.mark.skipif(step_ops.extension() is None, reason="the fused ops could not be built here")


def passes(runner: ModelRunner) -> list[torch.Tensor]:
    """Logits, hidden states and the cache after a 40-token prefill of 2 rows, then passes of 1, 8 and 3 tokens."""
    static = StaticRunner.of(runner, compiled=False)
    generator = torch.Generator().manual_seed(0)
    cache = static.new_cache()
    out = []
    for k, row_invariant in ((40, False), (1, True), (8, True), (3, True)):
        logits, hidden = static.forward(cache, torch.randint(0, min(1000, runner.vocab_size), (2, k), generator=generator), hidden_states=True,
                                        row_invariant=row_invariant)
        cache.commit(torch.ones(2, k, dtype=torch.bool))
        out += [logits, *hidden]
    written = int(cache.lengths.max())  # past it the cache's memory is untouched: any bits (StaticCache)
    return out + [t[:, :, :written] for t in cache.keys + cache.values]


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


class CountedLayer:
    """A KernelLayer whose calls are counted; `perturbed` scales each MLP output by 1 + 2^-6 (the negative control)."""

    def __init__(self, layer, calls: list, perturbed: bool = False):
        self.layer, self.calls, self.perturbed = layer, calls, perturbed

    def attention_in(self, *args):
        self.calls.append(1)
        return self.layer.attention_in(*args)

    def mlp(self, *args):
        hidden, delta = self.layer.mlp(*args)
        return hidden, delta * (1 + 2**-6) if self.perturbed else delta


def counted(calls: list, perturbed: bool = False):
    """step_ops.kernel_layers with each layer a CountedLayer."""
    kernel_layers = step_ops.kernel_layers

    def layers(model):
        made = kernel_layers(model)
        return made and [CountedLayer(layer, calls, perturbed) for layer in made]

    return layers


@pytest.fixture(scope="module", params=["smollm2-int4", "tiny-qwen2-int4-fp32", "tiny-qwen2-int4-bf16"])
def int4_runner(request, smollm2_int4) -> ModelRunner:  # noqa: F811
    """SmolLM2 (real weights, no biases) and a tiny Qwen2 (q/k/v biases) in float32 and bf16, on int4 weights."""
    if request.param == "smollm2-int4":
        return smollm2_int4
    dtype = request.param.rpartition("-")[2]
    return load_runner("tiny-random-qwen2", ModelConfig(target="tiny-random-qwen2", dtype=dtype, weights="int4", device="cpu"))


@needs_ops
def test_the_fused_ops_and_kernel_layers_compute_the_modules_numbers_bit_for_bit(int4_runner, kernel_family):  # noqa: F811
    with mock.patch.object(step_ops, "for_pass", lambda hidden: None):
        modules = passes(int4_runner)
    with mock.patch.object(step_ops, "kernel_layers", lambda model: None):
        fused = passes(int4_runner)
    calls: list = []
    with mock.patch.object(step_ops, "kernel_layers", counted(calls)):
        on_kernel_layers = passes(int4_runner)
    assert calls, "no pass ran on KernelLayers"
    for variant in (fused, on_kernel_layers):
        assert len(variant) == len(modules) and all(torch.equal(a, b) for a, b in zip(variant, modules))

    if int4_runner.dtype == torch.bfloat16:  # in float32 rounding once is rounding each product: no control there

        class NaiveOps:  # a negative control: the same ops, the rotation rounded once
            add_rms_norm = staticmethod(step_ops.extension().add_rms_norm)
            rotate_and_cache = staticmethod(rounded_once)

        with mock.patch.object(step_ops, "for_pass", lambda hidden: NaiveOps), \
                mock.patch.object(step_ops, "kernel_layers", lambda model: None):
            naive = passes(int4_runner)
        assert not all(torch.equal(a, b) for a, b in zip(naive, modules))
    with mock.patch.object(step_ops, "kernel_layers", counted([], perturbed=True)):  # another: a KernelLayer off by a bit
        perturbed = passes(int4_runner)
    assert not all(torch.equal(a, b) for a, b in zip(perturbed, modules))


def test_long_passes_and_float_projections_take_the_modules(long_passes_dequantize):
    """A pass that would dequantize its weights, or a model with float projections, has no KernelLayers."""
    hidden = torch.zeros(1, vnni.DEQUANTIZE_ROWS, 8, dtype=torch.bfloat16)
    assert not step_ops.takes_kernel_layers(hidden, kept=False)
    with vnni.row_invariant(True):  # a row-invariant pass takes the kernel at any length
        assert step_ops.takes_kernel_layers(hidden, kept=False) == (step_ops.extension() is not None)
    shorter = hidden[:, : vnni.DEQUANTIZE_ROWS_KEPT_AMX]  # dequantized sooner where kept weights meet AMX
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vnni, "bf16_tiles", lambda: True)
        assert not step_ops.takes_kernel_layers(shorter, kept=True)
        assert step_ops.takes_kernel_layers(shorter, kept=False) == (step_ops.extension() is not None)
    float_model = load_runner("tiny-random-qwen2", ModelConfig(target="tiny-random-qwen2", dtype="fp32", device="cpu")).model
    assert step_ops.kernel_layers(float_model) is None


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [96, 100])  # whole registers, and a scalar tail after them
def test_the_residual_norm_is_the_modules_with_and_without_a_delta(dtype, size, kernel_family):  # noqa: F811
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    torch.manual_seed(1)
    norm = Qwen2RMSNorm(size, eps=1e-6).to(dtype)
    norm.weight.data.normal_()
    hidden, delta = torch.randn(2, 5, size, dtype=dtype), torch.randn(2, 5, size, dtype=dtype)
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


@needs_ops
def test_kernel_layers_take_an_attention_wider_than_the_hidden_size():
    """A Llama whose heads * head_dim (128) is not its hidden size (64): o_proj reads the attention's width."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec_core.models.quant import quantize_model
    from specdec_core.models.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="specdec").to(torch.bfloat16).eval()
    runner = ModelRunner(model, tokenizer, "wide-attention")
    quantize_model(model, "int4")
    assert step_ops.kernel_layers(model) is not None
    with mock.patch.object(step_ops, "for_pass", lambda hidden: None):
        modules = passes(runner)
    calls: list = []
    with mock.patch.object(step_ops, "kernel_layers", counted(calls)):
        on_kernel_layers = passes(runner)
    assert calls and all(torch.equal(a, b) for a, b in zip(on_kernel_layers, modules))
