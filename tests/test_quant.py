"""Weight-only int8 / int4 linear layers, their packed-weight cache, and decoding over a quantized target."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from specdec_core.models.loading import load_runner
from specdec_core.build import build_engine
from specdec_core.config import Config, ModelConfig
from specdec_core.control import Controller
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.drafters.ngram import NgramDrafter
from specdec_core.engine import Engine
from specdec_core.models import vnni, quant
from specdec_core.models.gguf_blocks import SUPPORTED as GGUF_TYPES, UnsupportedTensor, repack
from specdec_core.models.quant import Int4Linear, Int8Linear, VnniLinear, UnsupportedLayer, quantize_int4, quantize_int8, quantize_model
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence

from .helpers import GGUF_BLOCKS, gguf_tensor

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TINY = "tiny-random-llama"


def dequantized(linear: nn.Linear, precision: str, group_size: int) -> torch.Tensor:
    """The float32 weight a quantized layer stands for, from the quantization math alone (no kernel)."""
    weight, dtype = linear.weight.detach(), linear.weight.dtype
    if precision == "int8":
        q, scales = quantize_int8(weight, dtype)
        return q.float() * scales.float()[:, None]
    q, scales_and_zeros = quantize_int4(weight, group_size, dtype)
    scales, zeros = scales_and_zeros.float().transpose(0, 1).unbind(dim=2)  # each [N, K / group]
    n, k = q.shape
    groups = q.float().reshape(n, k // group_size, group_size)
    return ((groups - 8) * scales[..., None] + zeros[..., None]).reshape(n, k)


def quantized(linear: nn.Linear, precision: str, group_size: int) -> nn.Module:
    return Int4Linear.from_linear(linear, group_size) if precision == "int4" else Int8Linear.from_linear(linear)


@pytest.mark.parametrize("precision,group_size", [("int8", 0), ("int4", 32), ("int4", 64)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("leading", [(5,), (2, 3)], ids=["2d", "3d"])
def test_layer_matches_its_dequantized_reference(precision: str, group_size: int, dtype: str, leading: tuple[int, ...]):
    torch.manual_seed(0)
    linear = nn.Linear(128, 48, bias=True, dtype=DTYPES[dtype])
    x = torch.randn(*leading, 128, dtype=DTYPES[dtype])
    out = quantized(linear, precision, group_size)(x)
    reference = x.float() @ dequantized(linear, precision, group_size).T + linear.bias.float()
    assert out.shape == (*leading, 48) and out.dtype == DTYPES[dtype]
    # fp32: the kernel's own rounding only; bf16: activations and output rounded to 8 mantissa bits.
    tolerance = 1e-4 if dtype == "fp32" else 2e-2
    assert (out.float() - reference).abs().max() <= tolerance * reference.abs().max()


needs_vnni = pytest.mark.skipif(vnni.extension() is None, reason="no AVX2 CPU or no compiler here")
FAMILIES_HERE = [name for name in vnni.FAMILIES if vnni.runs_here(name) and vnni.family_kernel(name) is not None]


@pytest.fixture(params=list(vnni.FAMILIES))
def kernel_family(request, monkeypatch):
    """Each kernel family this CPU runs, forced by SPECDEC_ISA; the path is chosen again after the test."""
    if request.param not in FAMILIES_HERE:
        pytest.skip(f"the {request.param} kernel does not run here")
    monkeypatch.setenv(vnni.ISA_ENV, request.param)
    vnni.choose_anew()
    assert vnni.family() == request.param
    yield request.param
    vnni.choose_anew()


def vnni_reference(linear: nn.Linear, precision: str, x: torch.Tensor, quantize_x: bool) -> torch.Tensor:
    """x @ w.T in float64 from the quantization math alone (no packing, no kernel): weights q * scale + min
    with float16 scales and mins, and with `quantize_x` each 32 inputs of x rounded to int8 as the kernel does."""
    weight = linear.weight.detach()
    if precision == "int4":
        q, scales_and_zeros = quantize_int4(weight, 32, torch.float16)
        scales, zeros = scales_and_zeros.double().transpose(0, 1).unbind(dim=2)
        mins = (zeros - 8 * scales).half().double()
    else:
        q, scales, mins = quant.quantize_uint_groups(weight, 32, int(precision[3:]))
        scales, mins = scales.double(), mins.double()
    n, k = q.shape
    w = (q.double().reshape(n, k // 32, 32) * scales[..., None] + mins[..., None]).reshape(n, k)
    x = x.double()
    if quantize_x:
        groups = x.reshape(x.shape[0], k // 32, 32)
        step = groups.abs().amax(dim=2, keepdim=True) / 127
        x = (torch.round(groups / step) * step).reshape_as(x)
    return x @ w.T


@needs_vnni
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 64, vnni.DEQUANTIZE_ROWS])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("precision", quant.PRECISIONS)
def test_vnni_layer_matches_its_reference(precision: str, rows: int, dtype: str, kernel_family: str):
    torch.manual_seed(3)
    linear = nn.Linear(256, 48, bias=False, dtype=DTYPES[dtype])
    x = torch.randn(rows, 256, dtype=DTYPES[dtype])
    out = VnniLinear.from_linear(linear, precision)(x)
    long_pass = rows >= vnni.DEQUANTIZE_ROWS  # weights dequantized to bf16, x not rounded
    reference = vnni_reference(linear, precision, x, quantize_x=not long_pass)
    assert out.shape == (rows, 48) and out.dtype == DTYPES[dtype]
    # Integer sums are exact: what is left is float32 accumulation (and bf16 rounding where used).
    tolerance = 1e-5 if dtype == "fp32" and not long_pass else 1e-2
    assert (out.double() - reference).abs().max() <= tolerance * reference.abs().max()


@needs_vnni
@pytest.mark.parametrize("precision", quant.PRECISIONS)
def test_vnni_rows_do_not_depend_on_the_pass(precision: str, kernel_family: str):
    """A row's result is the same in a pass of one row or of many, on each family: a verify pass over
    several tokens computes exactly what the single-token steps of plain decoding compute."""
    torch.manual_seed(4)
    layer = VnniLinear.from_linear(nn.Linear(512, 64, bias=False, dtype=torch.bfloat16), precision)
    x = torch.randn(vnni.DEQUANTIZE_ROWS - 1, 512, dtype=torch.bfloat16)
    together = layer(x)
    for rows in (slice(0, 1), slice(5, 7), slice(9, 14), slice(3, 19), slice(40, 104), slice(0, None)):
        assert torch.equal(layer(x[rows]), together[rows])


@needs_vnni
def test_a_row_invariant_pass_stays_on_the_kernel_past_the_dequantizing_rows(kernel_family: str, long_passes_dequantize):
    """A verify pass over many rows (a batch of 16 by a tree of 16 nodes) computes each row as a single step does
    under vnni.row_invariant; without it such a pass takes the bf16 GEMM, and some row differs (the control)."""
    torch.manual_seed(5)
    layer = VnniLinear.from_linear(nn.Linear(512, 64, bias=False, dtype=torch.bfloat16), "int4")
    x = torch.randn(vnni.DEQUANTIZE_ROWS + 40, 512, dtype=torch.bfloat16)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    with vnni.row_invariant(True):
        assert torch.equal(layer(x), alone)
    assert not torch.equal(layer(x), alone)


def gguf_layer(qtype: str, out_features: int, in_features: int, seed: int, bias: bool = False) -> VnniLinear:
    """A layer of a GGUF tensor of random blocks (helpers.gguf_tensor), in bf16."""
    blocks = gguf_tensor(qtype, out_features, in_features, seed)
    layer = VnniLinear(*repack(blocks, qtype, out_features, in_features), torch.randn(out_features).bfloat16() if bias else None)
    layer.dtype = torch.bfloat16
    return layer


@needs_vnni
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("precision", [*quant.PRECISIONS, "Q4_K", "Q6_K"])
def test_fused_projections_equal_the_separate_ones_bit_for_bit(precision: str, bias: bool, kernel_family: str):
    """q, k and v fused into one layer (one activation quantization, one kernel call) give each output row
    exactly what its own layer gives, at every pass length, and the separate layers then read views of the
    fused weights (nothing is kept twice) and still give the same; a GGUF file's K-quants too."""
    torch.manual_seed(6)
    if precision in GGUF_TYPES:
        layers = [gguf_layer(precision, out, 256, seed=out, bias=bias) for out in (128, 32, 48)]
    else:
        layers = [VnniLinear.from_linear(nn.Linear(256, out, bias=bias, dtype=torch.bfloat16), precision) for out in (128, 32, 32)]
    x = torch.randn(vnni.DEQUANTIZE_ROWS + 5, 256, dtype=torch.bfloat16)
    apart = {rows: [layer(x[:rows]) for layer in layers] for rows in (1, 2, 8, 33, vnni.DEQUANTIZE_ROWS - 1, vnni.DEQUANTIZE_ROWS + 5)}
    fused = quant.fuse(layers)
    assert fused.out_features == sum(layer.out_features for layer in layers) and (fused.bias is not None) == bias
    for rows, outputs in apart.items():
        assert torch.equal(fused(x[:rows]), torch.cat(outputs, dim=-1))
        assert all(torch.equal(layer(x[:rows]), out) for layer, out in zip(layers, outputs))
    assert all(layer.packed.untyped_storage().data_ptr() == fused.packed.untyped_storage().data_ptr() for layer in layers)


@needs_vnni
def test_kept_bf16_weights_give_the_same_long_passes_and_are_kept_once(kernel_family: str, long_passes_dequantize):
    """keep_dequantized: a long pass (a prefill chunk) on the bf16 weights the first one dequantized equals one
    that dequantizes them again, for a fused layer's parts too; short passes stay on the integer kernel."""
    torch.manual_seed(8)
    model = nn.Sequential(*[VnniLinear.from_linear(nn.Linear(256, out, dtype=torch.bfloat16), "int4") for out in (64, 32)])
    fused = quant.fuse(list(model))
    x = torch.randn(vnni.DEQUANTIZE_ROWS + 3, 256, dtype=torch.bfloat16)
    expected = [layer(x) for layer in (*model, fused)]
    short = [layer(x[:5]) for layer in model]
    quant.keep_dequantized(model, True)
    fused.keeps_dequantized = True
    for _ in range(2):
        assert all(torch.equal(layer(x), out) for layer, out in zip((*model, fused), expected))
    assert [len(layer._dequantized) for layer in (*model, fused)] == [1, 1, 2]
    assert all(torch.equal(layer(x[:5]), out) for layer, out in zip(model, short))
    quant.keep_dequantized(model, False)
    assert model[0]._dequantized is None and not model[0].keeps_dequantized


@needs_vnni
def test_kept_weights_take_the_bf16_product_sooner_on_amx(monkeypatch):
    """Where the CPU multiplies bf16 on AMX tiles, a kept layer takes the bf16 product from DEQUANTIZE_ROWS_KEPT_AMX
    rows, on its weights prepacked once for oneDNN's matmul; unkept, the kernel up to DEQUANTIZE_ROWS and torch.mm
    past it. Each equals that path's own product."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bf16 matmul on this CPU")
    monkeypatch.setattr(vnni, "bf16_tiles", lambda: True)
    torch.manual_seed(9)
    layer = VnniLinear.from_linear(nn.Linear(256, 64, bias=False, dtype=torch.bfloat16), "int4")
    x = torch.randn(vnni.DEQUANTIZE_ROWS_KEPT_AMX, 256, dtype=torch.bfloat16)
    on_kernel = vnni.mm(x, layer.packed, layer.scale_min)
    weights = vnni.dequantize_t(layer.packed, layer.scale_min).to(x.dtype)
    prepacked = torch.ops.mkldnn._reorder_linear_weight(weights.T.contiguous(), vnni.DEQUANTIZE_ROWS)
    bf16_product = torch.ops.mkldnn._linear_pointwise(x, prepacked, None, "none", [None], "")
    assert not torch.equal(on_kernel, bf16_product)
    assert torch.equal(layer(x), on_kernel)
    quant.keep_dequantized(layer, True)
    assert torch.equal(layer(x), bf16_product)
    assert torch.equal(layer(x[:-1]), vnni.mm(x[:-1], layer.packed, layer.scale_min))  # a row fewer: the kernel
    longer = torch.randn(vnni.DEQUANTIZE_ROWS, 256, dtype=torch.bfloat16)
    assert torch.equal(layer(longer), torch.ops.mkldnn._linear_pointwise(longer, prepacked, None, "none", [None], ""))
    assert layer._dequantized[0].is_mkldnn
    quant.keep_dequantized(layer, False)
    assert torch.equal(layer(longer), torch.mm(longer, weights))


@needs_vnni
@pytest.mark.parametrize("kept", [True, False])
def test_without_amx_tiles_every_pass_stays_on_the_kernel(kept: bool, monkeypatch):
    """On a CPU without AMX's bf16 tiles the kernel takes passes of every length, prefills too, kept weights or not
    (it was faster at every length measured), so nothing is dequantized or kept, and a long pass's every row is what
    a one-row pass computes; the control: with AMX tiles the same pass takes the bf16 product."""
    monkeypatch.setattr(vnni, "bf16_tiles", lambda: False)
    torch.manual_seed(10)
    layer = VnniLinear.from_linear(nn.Linear(256, 64, bias=False, dtype=torch.bfloat16), "int4")
    quant.keep_dequantized(layer, kept)
    x = torch.randn(2 * vnni.DEQUANTIZE_ROWS + 7, 256, dtype=torch.bfloat16)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(layer(x), alone)
    assert layer._dequantized is None
    monkeypatch.setattr(vnni, "bf16_tiles", lambda: True)
    assert not torch.equal(torch.mm(x, vnni.dequantize_t(layer.packed, layer.scale_min)), alone)  # the product rounds otherwise


@needs_vnni
@pytest.mark.parametrize("exact", [True, False])
def test_where_prefills_need_not_be_exact_the_warm_up_holds_their_weights_and_exact_ones_keep_none(exact, long_passes_dequantize):
    """prefill.exact (the default) on a CPU whose long passes take the bf16 product: the engine's prefills stay on
    the kernel, so no bf16 copy is ever made; with it off, Engine.warm_up (the server's, before it says ready)
    pays the first long pass's dequantization, not the first request."""
    config = Config.model_validate({"model": {"target": TINY, "dtype": "bf16", "weights": "int4", "device": "cpu"},
                                    "speculation": {"drafter": "ngram"}, "prefill": {"exact": exact}})
    engine = build_engine(config)
    assert engine.exact_prefill == exact and (engine.chunk_context_tokens is not None) == exact
    layers = [layer for layer in engine.target.model.modules() if isinstance(layer, VnniLinear)]
    assert layers and all(layer._dequantized is None for layer in layers)
    engine.warm_up()
    # All but the output layer: a prefill runs it on its last token only.
    assert sum(layer._dequantized is not None for layer in layers) == (0 if exact else len(layers) - 1)
    assert not engine.seqs and engine.chunks == 0  # nothing of the warm-up's stays


@needs_vnni
def test_the_warm_up_chooses_the_verify_passes_path_before_any_request(monkeypatch, isa_chosen_anew, long_passes_dequantize):
    """Where the tiles run, choosing them times both paths (tiles_faster): the warm-up pays that, not the first
    request's first pass of AMX_MIN_ROWS rows."""
    timed = []
    monkeypatch.setattr(vnni, "tiles_faster", lambda kernel: timed.append(kernel) or False)
    monkeypatch.delenv(vnni.ISA_ENV, raising=False)
    config = Config.model_validate({"model": {"target": TINY, "dtype": "bf16", "weights": "int4", "device": "cpu"},
                                    "speculation": {"drafter": "ngram"}})
    engine = build_engine(config)
    vnni.choose_anew()
    assert engine.target.row_invariant and vnni._tiles_chosen.cache_info().currsize == 0
    engine.warm_up()
    assert vnni._tiles_chosen.cache_info().currsize == 1
    assert len(timed) == (vnni.family() == "avx512" and vnni.amx_missing() is None)


def test_a_draft_models_prefill_passes_keep_their_weights_from_the_warm_up(long_passes_dequantize):
    # A warm-up chunk of DEQUANTIZE_ROWS tokens takes the bf16 product on any CPU: kept weights take it from 48 rows
    # where the CPU has AMX tiles (the default chunk, 48, reaches that), elsewhere, under the fixture, from 128.
    config = Config.model_validate({"model": {"target": TINY, "dtype": "bf16", "weights": "int4", "device": "cpu"},
                                    "speculation": {"drafter": "draft-model", "draft_model": TINY},
                                    "prefill": {"chunk_tokens": vnni.DEQUANTIZE_ROWS}})
    engine = build_engine(config)
    (draft,) = engine.drafter.own_models()
    layers = [layer for layer in draft.modules() if isinstance(layer, VnniLinear)]
    assert layers and all(layer.keeps_dequantized and layer._dequantized is None for layer in layers)
    engine.warm_up()
    assert sum(layer._dequantized is not None for layer in layers) == len(layers) - 1
    assert not engine.drafter.cache.batch_size  # the warm-up's row is not the drafter's


def test_layers_that_cannot_be_fused_are_left_alone():
    torch.manual_seed(7)
    floats = [nn.Linear(64, 32) for _ in range(2)]
    assert quant.fuse(floats) is None
    if vnni.extension() is not None:  # a run of one precision with a bias on some layers only
        mixed = [VnniLinear.from_linear(nn.Linear(64, 32, bias=bias), "int4") for bias in (True, False)]
        packed = [layer.packed for layer in mixed]
        assert quant.fuse(mixed) is None and all(layer.packed is p for layer, p in zip(mixed, packed))


@needs_vnni
def test_layers_of_several_formats_fuse_by_runs_and_equal_the_separate_ones(kernel_family: str):
    """A GGUF file's q and k in Q4_K and its v in Q6_K: q and k fuse into one layer, v stays its own, and the fused
    projection gives what the three layers give, bit for bit."""
    layers = [gguf_layer("Q4_K", 128, 256, seed=1, bias=True), gguf_layer("Q4_K", 32, 256, seed=2, bias=True),
              gguf_layer("Q6_K", 32, 256, seed=3, bias=True)]
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    apart = {rows: torch.cat([layer(x[:rows]) for layer in layers], dim=-1) for rows in (1, 5, 64)}
    fused = quant.fuse(layers)
    assert isinstance(fused, quant.FusedLinear) and [run.precision for run in fused.runs] == ["q4_k", "q6_k"]
    assert fused.runs[1] is layers[2] and fused.out_features == 192
    for rows, expected in apart.items():
        assert torch.equal(fused(x[:rows]), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer_type", [Int4Linear, Int8Linear])
def test_torchs_cpu_kernels_rows_do_not_depend_on_the_pass(layer_type, dtype):
    """What ModelRunner.row_invariant rests on where our kernel cannot run: torch's CPU int4 and int8 kernels
    give a row the same result in a pass of any length (float GEMMs need not: fp32's here do not)."""
    torch.manual_seed(5)
    linear = nn.Linear(1536, 256, bias=False, dtype=dtype)
    layer = layer_type.from_linear(linear) if layer_type is Int8Linear else layer_type.from_linear(linear, 32)
    x = torch.randn(64, 1536, dtype=dtype)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(64)])
    for rows in (2, 3, 7, 16, 33, 64):
        assert torch.equal(layer(x[:rows]), alone[:rows])


needs_avx512 = pytest.mark.skipif("avx512" not in FAMILIES_HERE, reason="the AVX-512 VNNI kernel does not run here")
needs_amx = pytest.mark.skipif(vnni.amx_missing() is not None, reason=f"no AMX tiles here: {vnni.amx_missing()}")
AMX_ROWS = [2, 3, 8, 15, 16, 17, 31, 48, 64]


def packed_layer(precision: str, out_features: int, in_features: int, seed: int) -> VnniLinear:
    torch.manual_seed(seed)
    return VnniLinear.from_linear(nn.Linear(in_features, out_features, bias=False), precision)


def reference_group_sums(layer: VnniLinear, x: torch.Tensor) -> torch.Tensor:
    """The int32 sums [M, K/32, N] from the quantization math in torch: x's codes round(x * 127 / amax)
    per 32 inputs in float32, as the kernel rounds them, times the weights' codes, exactly (int64)."""
    n, k = layer.out_features, layer.in_features
    operands = layer.packed.view(n // 16, k // 32, -1, 64)
    if layer.precision in ("int4", "int6"):  # chunk c holds operand 2c in its low nibbles, 2c + 1 in its high
        low = torch.stack([operands[:, :, :4] & 15, operands[:, :, :4] >> 4], dim=3).flatten(2, 3)
        if layer.precision == "int6":  # chunk 4 + c holds operands 4c..4c + 3's top 2 bits, from the bottom
            tops = torch.stack([operands[:, :, 4:] >> shift & 3 for shift in (0, 2, 4, 6)], dim=3).flatten(2, 3)
            low = low | tops << 4
        operands = low
    # operands [N/16, K/32, 8, 64]: byte 4r + j of operand i is row r's code for input 4i + j.
    q = operands.view(n // 16, k // 32, 8, 16, 4).permute(0, 3, 1, 2, 4).reshape(n, k // 32, 32).long()
    groups = x.float().reshape(x.shape[0], k // 32, 32)
    amax = groups.abs().amax(dim=2, keepdim=True)
    # torch.full_like(amax, 127) / amax, as the kernel divides: 127 / amax is 127 * (1 / amax) in torch,
    # one rounding more, which moves codes that lie near a tie.
    inverse = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    codes = torch.round(groups * inverse).long()
    return torch.einsum("mgi,ngi->mgn", codes, q)


@needs_amx
@pytest.mark.parametrize("rows", AMX_ROWS)
@pytest.mark.parametrize("precision", quant.PRECISIONS)
def test_amx_group_sums_equal_vnni_and_the_reference(precision: str, rows: int):
    layer = packed_layer(precision, 48, 320, seed=5)
    x = torch.randn(rows, 320)
    amx_sums = vnni.group_sums(x, layer.packed, layer.scale_min, tiles=True)
    assert torch.equal(amx_sums, vnni.group_sums(x, layer.packed, layer.scale_min, tiles=False))
    assert torch.equal(amx_sums.long(), reference_group_sums(layer, x))


@needs_amx
@pytest.mark.parametrize("rows", AMX_ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("precision", quant.PRECISIONS)
def test_amx_outputs_equal_vnni_outputs(precision: str, dtype: str, rows: int):
    torch.manual_seed(6)
    linear = nn.Linear(352, 64, bias=False, dtype=DTYPES[dtype])
    layer = VnniLinear.from_linear(linear, precision)
    x = torch.randn(rows, 352, dtype=DTYPES[dtype])
    on_tiles = vnni.extension().mm(x, layer.packed, layer.scale_min, True)
    assert torch.equal(on_tiles, vnni.extension().mm(x, layer.packed, layer.scale_min, False))
    assert torch.equal(layer(x), on_tiles)  # what a layer computes at this many rows
    reference = vnni_reference(linear, precision, x, quantize_x=True)
    tolerance = 1e-5 if dtype == "fp32" else 1e-2
    assert (on_tiles.double() - reference).abs().max() <= tolerance * reference.abs().max()


@contextmanager
def every_kernel_set(setting: str, value: int) -> Iterator[int]:
    """Every family's kernel here that has `set_<setting>` set to `value`, and set back afterwards."""
    kernels = [kernel for kernel in map(vnni.family_kernel, FAMILIES_HERE) if hasattr(kernel, f"set_{setting}")]
    saved = [getattr(kernel, setting)() for kernel in kernels]
    for kernel in kernels:
        getattr(kernel, f"set_{setting}")(value)
    try:
        yield value
    finally:
        for kernel, old in zip(kernels, saved):
            getattr(kernel, f"set_{setting}")(old)


@pytest.fixture(params=[1, 2])
def register_blocks(request):
    """The AVX-512 kernel's short passes in register blocks of 1 and of 2 16-row blocks (vnni.register_blocks
    chooses one by this CPU's speed)."""
    with every_kernel_set("register_blocks", request.param) as blocks:
        yield blocks


@pytest.fixture(params=[0, vnni.FAR_PREFETCH_GROUPS])
def far_prefetch(request):
    """Every family's kernel with and without the far prefetch into L2 (vnni.far_prefetch chooses by this CPU's
    speed)."""
    with every_kernel_set("far_prefetch", request.param) as groups:
        yield groups


@needs_vnni
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("precision", quant.PRECISIONS)
def test_every_path_computes_the_same_bits_at_every_row_count(precision: str, dtype: str, register_blocks: int,
                                                               far_prefetch: int):
    """Each family (and AMX tiles, where they run), the AVX-512 one in register blocks of either size, with and
    without the far prefetch, gives every row of a pass of 1 to 64 rows exactly what a one-row pass on any other
    path gives: the integer sums (checked against the quantization math) and the outputs, bit for bit. So text
    does not depend on the batch, the pass, nor the CPU's kernel family."""
    layer = packed_layer(precision, 48, 352, seed=9)
    x = (torch.randn(64, 352) * 3).to(DTYPES[dtype])
    paths = [(vnni.family_kernel(name), False) for name in FAMILIES_HERE]
    if vnni.amx_missing() is None:
        paths.append((vnni.family_kernel("avx512"), True))
    alone = torch.cat([paths[0][0].mm(x[i : i + 1], layer.packed, layer.scale_min, False) for i in range(64)])
    sums = reference_group_sums(layer, x)
    for kernel, tiles in paths:
        assert torch.equal(kernel.group_sums(x, layer.packed, layer.scale_min, tiles).long(), sums)
        for rows in range(1, 65):
            assert torch.equal(kernel.mm(x[:rows], layer.packed, layer.scale_min, tiles), alone[:rows]), (kernel.__name__, tiles, rows)
        assert torch.equal(kernel.dequantize_t(layer.packed, layer.scale_min), paths[0][0].dequantize_t(layer.packed, layer.scale_min))


@pytest.mark.parametrize("cache_mb,copies,rounds", [(0, 8, 15), (32, 8, 15), (480, 88, 5), (10_000, 124, 5)])
def test_the_start_times_passes_over_copies_that_outgrow_the_cache(cache_mb: int, copies: int, rounds: int):
    """register_blocks, far_prefetch and tiles_faster time an 8.6 MB layer over copies 1.5x the last-level cache
    (at least 8, at most 1 GiB), in fewer rounds the more copies there are."""
    layer_bytes = 8960 * 1536 * 5 // 8
    assert vnni.timing_copies(layer_bytes, cache_mb << 20) == (copies, rounds)


def test_the_last_level_cache_is_read_from_sysfs():
    if not list(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")):
        pytest.skip("this machine's sysfs reports no CPU caches")
    assert vnni.last_level_cache_bytes() >= 256 << 10


@pytest.mark.parametrize("faster", [0, vnni.FAR_PREFETCH_GROUPS])
def test_the_far_prefetch_is_taken_where_it_passes_a_row_faster_and_the_log_says_so(faster, monkeypatch, caplog):
    """far_prefetch keeps whichever of none and FAR_PREFETCH_GROUPS timed faster, and logs both times."""
    ms = {0: 0.30, vnni.FAR_PREFETCH_GROUPS: 0.30} | {faster: 0.25}
    monkeypatch.setattr(vnni, "_pass_ms", lambda kernel, rows, variants: {groups: ms[groups] for groups in variants})
    with caplog.at_level(logging.INFO, logger="specdec"):
        assert vnni.far_prefetch(SimpleNamespace(set_far_prefetch=lambda groups: None)) == faster
    said = f"{faster} groups ahead (one row" if faster else "by the CPU alone"
    assert f"weights prefetched into L2 {said}" in caplog.text and "0.250 ms, 0.300 ms" in caplog.text


@pytest.mark.parametrize("flags,asked,chosen,said", [
    ("avx512", None, "avx512", ""),
    ("avx2", None, "avx2", ""),
    ("avx2 and avx_vnni", None, "avxvnni", ""),
    ("avx2", "avxvnni", "avx2", "SPECDEC_ISA=avxvnni, but this CPU lacks avx_vnni"),
    ("avx512", "avxvnni", "avx512", "SPECDEC_ISA=avxvnni, but this CPU lacks avx_vnni"),
    ("avx2", "avx512", "avx2", "SPECDEC_ISA=avx512, but this CPU lacks avx512f"),
    ("avx2", "amx", "avx2", "SPECDEC_ISA=amx, but this CPU lacks avx512f"),
    ("avx512", "avx2", "avx2", ""),
    ("none", None, None, "this CPU lacks AVX2"),
])
def test_the_family_is_chosen_from_the_cpu_flags_and_says_why(flags, asked, chosen, said, monkeypatch, caplog, isa_chosen_anew):
    """Unset, the widest family the CPU runs; SPECDEC_ISA forces one, and where the CPU lacks it the widest
    it has runs instead, with the missing flags in the log; with no AVX2, torch's kernels."""
    cpu = {"avx512": set(vnni.FAMILIES["avx512"].cpu_flags) | set(vnni.FAMILIES["avx2"].cpu_flags),
           "avx2": set(vnni.FAMILIES["avx2"].cpu_flags), "avx2 and avx_vnni": set(vnni.FAMILIES["avxvnni"].cpu_flags),
           "none": {"sse4_2"}}[flags]
    monkeypatch.setattr(vnni, "_cpu_flags", lambda: cpu)
    if asked:
        monkeypatch.setenv(vnni.ISA_ENV, asked)
    else:
        monkeypatch.delenv(vnni.ISA_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="specdec"):
        assert vnni.family() == chosen
    assert said in caplog.text


class PathSpy:
    """The kernel, recording which path each mm call asked for."""

    def __init__(self, kernel):
        self.kernel, self.tiles = kernel, []

    def __getattr__(self, name: str):
        return getattr(self.kernel, name)

    def mm(self, x, packed, scale_min, tiles):
        self.tiles.append(tiles)
        return self.kernel.mm(x, packed, scale_min, tiles)


@pytest.fixture
def isa_chosen_anew():
    """vnni's path chosen again from this test's environment and CPU, and again after it, from this machine's."""
    vnni.choose_anew()
    yield
    vnni.choose_anew()


@needs_avx512
@pytest.mark.parametrize("cause", ["forced avx512", "tiles slower", "no cpu flags", "permission refused"])
def test_without_amx_every_pass_runs_on_vnni_and_says_why(cause: str, monkeypatch, caplog, isa_chosen_anew):
    spy = PathSpy(vnni.family_kernel("avx512"))
    monkeypatch.setattr(vnni, "family_kernel", lambda name: spy)
    monkeypatch.setattr(vnni, "_cpu_flags", lambda: set(vnni.FAMILIES["avx512"].cpu_flags) | set(vnni.AMX_FLAGS))
    monkeypatch.setattr(spy, "amx_enable", lambda: cause != "permission refused", raising=False)  # as if Linux grants it
    monkeypatch.setattr(vnni, "tiles_faster", lambda kernel: cause != "tiles slower")
    if cause == "forced avx512":
        monkeypatch.setenv(vnni.ISA_ENV, "avx512")
    elif cause == "tiles slower":
        monkeypatch.delenv(vnni.ISA_ENV, raising=False)
    else:
        monkeypatch.setenv(vnni.ISA_ENV, "amx")
    if cause == "no cpu flags":
        monkeypatch.setattr(vnni, "_cpu_flags", lambda: set(vnni.FAMILIES["avx512"].cpu_flags))
    with caplog.at_level(logging.INFO, logger="specdec"):
        assert not vnni.amx()
    layer = packed_layer("int4", 32, 64, seed=7)
    x = torch.randn(vnni.AMX_MIN_ROWS, 64)
    together = layer(x)
    assert spy.tiles == [False]
    assert torch.equal(layer(x[2:3]), together[2:3])
    reason = {"forced avx512": "SPECDEC_ISA=avx512", "tiles slower": "AMX tiles slower here", "no cpu flags": "lacks amx_tile, amx_int8",
              "permission refused": "refused"}[cause]
    assert reason in caplog.text and "on AVX-512 VNNI" in caplog.text


@needs_amx
def test_with_isa_unset_the_tiles_take_passes_where_they_are_faster(monkeypatch, caplog, isa_chosen_anew):
    """The control of the test above: the same choice, the tiles faster, takes them from AMX_MIN_ROWS rows."""
    monkeypatch.delenv(vnni.ISA_ENV, raising=False)
    spy = PathSpy(vnni.family_kernel("avx512"))
    monkeypatch.setattr(vnni, "family_kernel", lambda name: spy)
    monkeypatch.setattr(vnni, "tiles_faster", lambda kernel: True)
    with caplog.at_level(logging.INFO, logger="specdec"):
        assert vnni.amx()
    layer = packed_layer("int4", 32, 64, seed=7)
    layer(torch.randn(vnni.AMX_MIN_ROWS - 1, 64))
    layer(torch.randn(vnni.AMX_MIN_ROWS, 64))
    assert spy.tiles == [False, True]
    assert "SPECDEC_ISA unset, faster here" in caplog.text


@needs_amx
def test_tiles_faster_times_both_paths_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="specdec"):
        faster = vnni.tiles_faster(vnni.family_kernel("avx512"))
    on_tiles, on_vnni = (float(ms) for ms in re.findall(r"([0-9.]+) ms on", caplog.text))
    assert faster == (on_tiles < on_vnni)


def test_an_unknown_isa_is_refused_with_the_choices(monkeypatch, isa_chosen_anew):
    monkeypatch.setenv(vnni.ISA_ENV, "sse2")
    with pytest.raises(ValueError, match="avx2, avxvnni, avx512, amx"):
        vnni.isa()


@needs_amx
def test_amx_takes_passes_from_amx_min_rows(monkeypatch, isa_chosen_anew, long_passes_dequantize):
    monkeypatch.setenv(vnni.ISA_ENV, "amx")
    spy = PathSpy(vnni.family_kernel("avx512"))
    monkeypatch.setattr(vnni, "family_kernel", lambda name: spy)
    layer = packed_layer("int8", 32, 64, seed=8)
    for rows in (1, vnni.AMX_MIN_ROWS, vnni.DEQUANTIZE_ROWS - 1, vnni.DEQUANTIZE_ROWS):
        layer(torch.randn(rows, 64))
    assert spy.tiles == [False, True, True]  # the last pass dequantizes instead (AMX hosts have bf16 tiles)


@needs_vnni
def test_int4_on_this_cpu_uses_the_vnni_kernel(tmp_path):
    model = tiny_runner().model
    quantize_model(model, "int4", 32, quant.cache_file(tmp_path, "int4", 32, torch.device("cpu")))
    assert {m.precision for m in model.modules() if isinstance(m, VnniLinear)} == {"int4", quant.HEAD_WEIGHTS}  # the head
    assert not any(isinstance(m, (Int4Linear, Int8Linear)) for m in model.modules())
    assert (tmp_path / "packed-int4-g32-vnni.safetensors").is_file()


def test_int4_without_the_vnni_kernel_uses_torchs(tmp_path, monkeypatch):
    monkeypatch.setattr(vnni, "extension", lambda: None)
    model = tiny_runner().model
    quantize_model(model, "int4", 32, quant.cache_file(tmp_path, "int4", 32, torch.device("cpu")))
    assert any(isinstance(m, Int4Linear) for m in model.modules())
    assert (tmp_path / "packed-int4-g32-cpu.safetensors").is_file()


def test_int8_error_is_half_a_step():
    torch.manual_seed(1)
    linear = nn.Linear(64, 32, bias=False)
    step = linear.weight.detach().abs().amax(dim=1, keepdim=True) / 127
    assert ((dequantized(linear, "int8", 0) - linear.weight).abs() <= step / 2 + 1e-7).all()


def test_int4_finds_a_grid_whose_extremes_are_unused():
    """Weights converted from a 4-bit GGUF sit on a grid per group, often without its top code:
    plain min/max would stretch the step by 15/14; the step search lands on the grid again."""
    torch.manual_seed(2)
    codes = torch.randint(0, 15, (32, 2, 32)).float()
    codes[..., 0], codes[..., 1] = 0, 14  # each group spans 14 steps of its grid
    step, base = torch.rand(32, 2, 1) / 100 + 1e-3, torch.randn(32, 2, 1) / 10
    linear = nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        linear.weight.copy_((codes * step + base).reshape(32, 64))
    error = (dequantized(linear, "int4", 32) - linear.weight).abs().max()
    assert error <= 1e-6 * linear.weight.abs().max()


def test_int4_quantizes_on_the_weights_device():
    """Every tensor of the step search lives where the weight does: on CUDA a CPU index made every layer fall
    back to bf16 (seen on an H200). The meta device refuses the mix as CUDA does, and runs without memory."""
    q, scales_and_zeros = quantize_int4(torch.empty(32, 64, device="meta"), 32, torch.bfloat16)
    assert q.device.type == scales_and_zeros.device.type == "meta"
    assert q.shape == (32, 64) and scales_and_zeros.shape == (2, 32, 2)


@pytest.mark.parametrize(
    "out_features,in_features,group_size,reason",
    [(40, 64, 32, "multiple of 16"), (32, 48, 32, "multiple of the group size"), (32, 64, 16, "group size 16")],
)
def test_int4_refuses_shapes_the_kernel_cannot_take(out_features: int, in_features: int, group_size: int, reason: str):
    with pytest.raises(UnsupportedLayer, match=reason):
        Int4Linear.from_linear(nn.Linear(in_features, out_features), group_size)


def tiny_runner(dtype: str = "fp32", seed: int = 0):
    return load_runner(f"{TINY}@{seed}", ModelConfig(target=TINY, dtype=dtype))


def logits_of(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.arange(1, 20)[None]).logits


def test_unpackable_layers_fall_back_to_int8_and_say_so(caplog):
    model = tiny_runner().model
    with caplog.at_level(logging.WARNING, logger="specdec"):
        # Group 128: layers with 64 inputs cannot be int4, down_proj (128 inputs) can.
        layers = quantize_model(model, "int4", group_size=128)
    assert layers["model.layers.0.mlp.down_proj"] == "int4"
    assert layers["model.layers.0.self_attn.q_proj"] == "int8"
    # The output layer's default is int6 on our kernel, which takes groups of 32 alone: on torch's, int8.
    assert quant.HEAD_WEIGHTS == "int6" and layers["lm_head"] == "int8"
    assert "q_proj cannot be int4" in caplog.text and "lm_head" not in caplog.text


def test_an_int6_output_layer_asked_where_our_kernel_does_not_run_falls_back_to_int8_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="specdec"):
        layers = quantize_model(tiny_runner().model, "int4", group_size=128, head_weights="int6")
    assert layers["lm_head"] == "int8" and "lm_head cannot be int6 (int6 runs on our kernel only" in caplog.text


@pytest.mark.parametrize("weights", quant.QUANTIZED)
def test_packed_cache_round_trip(tmp_path, monkeypatch, weights: str):
    path = quant.cache_file(tmp_path, weights, 32, torch.device("cpu"))
    first = tiny_runner().model
    layers = quantize_model(first, weights, 32, path)
    assert path.is_file() and path.with_suffix(".json").is_file()

    # A fresh model loads the packed weights: quantizing again would fail here.
    def no_quantizing(*args):
        raise AssertionError("quantized again instead of loading the cache")

    monkeypatch.setattr(quant, "_quantize_with_fallback", no_quantizing)
    second = tiny_runner().model
    assert quantize_model(second, weights, 32, path) == layers
    assert torch.equal(logits_of(first), logits_of(second))
    # The kernels use aligned vector loads: a weight at an odd offset of the file crashes them.
    assert all(t.data_ptr() % 64 == 0 for t in second.buffers())


def test_cache_made_from_other_weights_is_not_served(tmp_path):
    path = quant.cache_file(tmp_path, "int8", 32, torch.device("cpu"))
    quantize_model(tiny_runner(seed=0).model, "int8", 32, path)
    other, reference = tiny_runner(seed=1).model, tiny_runner(seed=1).model
    quantize_model(other, "int8", 32, path)
    quantize_model(reference, "int8", 32)
    assert torch.equal(logits_of(other), logits_of(reference))


def greedy_decode(runner, drafter, prompt: list[int], max_tokens: int) -> Sequence:
    engine = Engine(runner, drafter, Controller(fixed_gamma=3), set())
    seq = Sequence("r", prompt, SamplingParams(temperature=0.0), max_tokens)
    engine.add(seq)
    while not seq.finished:
        engine.step()
    return seq


@pytest.mark.parametrize("weights", quant.QUANTIZED)
def test_speculative_greedy_over_a_quantized_target_equals_its_plain_greedy(weights: str):
    runner = load_runner(TINY, ModelConfig(target=TINY, dtype="fp32", weights=weights))
    assert any(isinstance(m, quant.QuantLinear) for m in runner.model.modules())
    # A repetitive prompt, so that the n-gram drafter has matches to propose.
    prompt = runner.tokenizer("def f(x):\n    return x\ndef g(x):\n    return x\ndef")["input_ids"]
    plain = greedy_decode(runner, None, prompt, 40)
    speculative = greedy_decode(runner, NgramDrafter(1, 3, 8), prompt, 40)
    assert len(plain.output_ids) == 40
    assert speculative.stats.accepted_tokens > 0  # the verify pass really took several tokens
    assert speculative.output_ids == plain.output_ids


def test_float_weights_other_than_the_dtype_are_refused():
    with pytest.raises(ValueError, match="float weights are kept in dtype"):
        ModelConfig(dtype="bf16", weights="fp32")
    assert ModelConfig(dtype="bf16", weights="bf16").weights == "bf16"


@pytest.mark.parametrize("setting", ["t1", "t0.7-top_p0.9"])
def test_speculative_sampling_over_an_int4_target_is_distributed_as_it(setting: str, monkeypatch):
    """The chi-square test of test_exactness.py with an int4 target and the draft-model drafter, under rejection
    sampling. (Under the Gumbel rule, on the emulated kernel's numerics, seeds 0-9999 land in the test's tail,
    third token p 0.00045, where 20,000 fresh seeds give p 0.35-0.82: chance, at 4 x ALPHA a test.)"""
    from .helpers import tiny_runner as random_runner
    from .test_exactness import ALPHA, PARAMS, PROMPTS, ROWS, VOCAB, exact, generate, pvalues

    # Every pass through the one function (the batch of 10,000 rows would otherwise dequantize).
    monkeypatch.setattr(vnni, "DEQUANTIZE_ROWS", 10**9)
    target = random_runner(seed=0, vocab=VOCAB)
    assert "int4" in quantize_model(target.model, "int4", 32).values()
    prompt, params = PROMPTS["draft-model"], PARAMS[setting]
    drafter = DraftModelDrafter(random_runner(seed=1, vocab=VOCAB), VOCAB)
    tokens, seqs = generate(target, drafter, prompt, params, ROWS, "rejection")
    accepted = sum(seq.stats.accepted_tokens for seq in seqs)
    assert 0.1 * sum(seq.stats.draft_tokens for seq in seqs) < accepted
    result = pvalues(tokens, exact(target, prompt, params))
    assert min(result.values()) > ALPHA, result


@pytest.mark.parametrize("weights", quant.QUANTIZED)
def test_a_reduced_vocabulary_takes_the_rows_of_a_quantized_output_layer(weights: str):
    """EAGLE and Medusa over a quantized target slice its output layer for their reduced vocabulary."""
    from specdec_core.models.vocab import ReducedVocab

    model = tiny_runner(dtype="bf16").model
    quantize_model(model, weights, 32)
    output = model.get_output_embeddings()
    vocab = ReducedVocab(torch.tensor([0, 3, 7, 40]), output.out_features)
    x = torch.randn(5, output.in_features, dtype=torch.bfloat16)
    sliced = vocab.head(output)(x).float()
    full = output(x).float()[:, vocab.ids]
    assert (sliced - full).abs().max() <= 0.03 * full.abs().max()  # bf16, and int8 activations in the kernel


# -- a GGUF file's own blocks ---------------------------------------------------------------------------------------

# A byte of each type's first block that holds a code (its lowest bit: the code of one weight).
CODE_BYTE = {"Q4_K": 16, "Q6_K": 0, "Q4_1": 4, "Q5_0": 6, "Q8_0": 2}


def gguf_values(blocks, qtype: str, rows: int, inputs: int) -> torch.Tensor:
    """The tensor's values as the gguf package dequantizes them (float32), the reference for every type."""
    import gguf

    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])).reshape(rows, inputs)


@needs_vnni
@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_a_repacked_gguf_tensor_dequantizes_to_the_files_values(qtype: str, kernel_family: str):
    """Every value of a repacked tensor is the file's (the gguf package's dequantization, bit for bit), on each
    family; the control: one flipped code bit shows, at that weight alone."""
    rows, inputs = 32, 512
    blocks = gguf_tensor(qtype, rows, inputs, seed=1)
    expected = gguf_values(blocks, qtype, rows, inputs)
    assert torch.equal(vnni.dequantize_exact(*repack(blocks, qtype, rows, inputs)), expected)
    flipped = blocks.copy()
    flipped[5, CODE_BYTE[qtype]] ^= 1
    changed = vnni.dequantize_exact(*repack(flipped, qtype, rows, inputs)) != expected
    assert changed.sum() == 1 and changed[5].any()
    assert torch.equal(gguf_values(flipped, qtype, rows, inputs) != expected, changed)


def test_a_gguf_type_without_a_kernel_format_is_refused_by_name():
    with pytest.raises(UnsupportedTensor, match="Q5_K.*Q4_K, Q6_K"):
        repack(gguf_tensor("Q4_K", 16, 256, seed=0), "Q5_K", 16, 256)


def gguf_reference(blocks, qtype: str, x: torch.Tensor) -> torch.Tensor:
    """x @ w.T in float64 over the file's values, x rounded to int8 per 256 inputs (K-quants) or 32 as the kernel
    rounds it (float32 127 / amax, as reference_group_sums explains)."""
    rows, inputs = blocks.shape[0], x.shape[1]
    group = GGUF_BLOCKS[qtype][0]
    groups = x.float().reshape(x.shape[0], inputs // group, group)
    amax = groups.abs().amax(dim=2, keepdim=True)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    rounded = torch.round(groups * inverse).double() * (amax / 127).double()
    return rounded.reshape_as(x) @ gguf_values(blocks, qtype, rows, inputs).double().T


@needs_vnni
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_gguf_tensors_compute_the_same_bits_on_every_path_at_every_row_count(qtype: str, dtype: str, far_prefetch: int):
    """A GGUF tensor's passes on each family (AMX tiles where they run: a K-quant takes VNNI there), with and
    without the far prefetch, give every row of a pass of 1 to 64 rows exactly what a one-row pass gives, the
    same integer sums and dequantized weights, and the file's values times the rounded activations."""
    rows, inputs = 48, 512
    blocks = gguf_tensor(qtype, rows, inputs, seed=9)
    packed, scale_min = repack(blocks, qtype, rows, inputs)
    x = (torch.randn(64, inputs, generator=torch.Generator().manual_seed(2)) * 3).to(DTYPES[dtype])
    paths = [(vnni.family_kernel(name), False) for name in FAMILIES_HERE]
    if vnni.amx_missing() is None:
        paths.append((vnni.family_kernel("avx512"), True))
    alone = torch.cat([paths[0][0].mm(x[i : i + 1], packed, scale_min, False) for i in range(64)])
    reference = gguf_reference(blocks, qtype, x)
    tolerance = 1e-5 if dtype == "fp32" else 1e-2
    assert (alone.double() - reference).abs().max() <= tolerance * reference.abs().max()
    sums = paths[0][0].group_sums(x, packed, scale_min, False)
    for kernel, tiles in paths:
        assert torch.equal(kernel.group_sums(x, packed, scale_min, tiles), sums)
        for count in range(1, 65):
            assert torch.equal(kernel.mm(x[:count], packed, scale_min, tiles), alone[:count]), (kernel.__name__, tiles, count)
        assert torch.equal(kernel.dequantize_t(packed, scale_min), paths[0][0].dequantize_t(packed, scale_min))
