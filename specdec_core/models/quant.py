"""Weight-only int8 and int4 linear layers, and a cache of packed weights.

Decoding one token streams every weight from memory, so the bytes per weight set the speed
(DESIGN.md, "Why it works"). These layers keep activations in the model's dtype and store weights
as int8 or int4 codes; the kernels:

- On a CPU with AVX2 or AVX-512 VNNI, ours (vnni.py, `VnniLinear`): int4, int6 or int8 codes with a float16
  scale and min per 32 inputs, times activations rounded to int8 per 32 inputs; or a GGUF file's own blocks
  (`weights: gguf`, gguf_blocks.py), its K-quants in super-blocks of 256 inputs.
- Elsewhere torch's: int8 with one scale per output channel, `aten._weight_int8pack_mm` (CPU,
  CUDA, MPS, XPU); int4 with a scale and zero per `group_size` inputs,
  `aten._convert_weight_to_int4pack_for_cpu` + `aten._weight_int4pack_mm_for_cpu` on CPU,
  `aten._convert_weight_to_int4pack` + `aten._weight_int4pack_mm` on CUDA (bf16 activations).

A layer the kernels cannot take (shape, device or dtype) falls back to the next wider precision,
and the fallback is logged. Packing the weights of a big model takes a while (the 1.5B: 112 s
at one thread, against 2 s to load them), so the packed
tensors are cached as safetensors next to a JSON manifest of how they were made; the manifest is
renamed into place last, so its presence (with a matching key) means the cache is complete.
Measurements behind the defaults: docs/QUANT.md.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import time
import weakref
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from . import vnni
from .gguf_blocks import GgufFile, UnsupportedTensor

log = logging.getLogger("specdec")

QUANTIZED = ("int4", "int8")
# model.weights that serve a GGUF file's own blocks (gguf_blocks.py) rather than quantizing float weights.
GGUF = "gguf"
PACKED = (*QUANTIZED, GGUF)  # the model.weights whose layers are packed, and cached
# What a layer may get, narrowest first (a layer falls back to the next): int6 is our kernel's only (the output
# layer's default, below).
PRECISIONS = ("int4", "int6", "int8")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # the only group sizes the int4 kernels implement
# g32 matches the 32-weight blocks of the 4-bit GGUF tensors (Q4_K, Q4_1) our weights were
# converted from, so int4 can land on their grid again; g128 spans four blocks of different grids
# (1.5B perplexity +7%) for 3-10% of speed: docs/QUANT.md.
DEFAULT_GROUP_SIZE = 32
# Steps tried per int4 group: (max - min) / levels for each of these (see _quantize_int4_rows).
# On the Qwen Q4_K layers the best is 15 or 14 levels; 13 and 12 win now and then on Q6_K layers.
INT4_LEVELS = (15, 14, 13, 12)
ROWS_PER_CHUNK = 2048
# The output layer's default precision on our kernel (elsewhere int8: torch's kernels have no int6). It
# comes from a 6- or 8-bit GGUF tensor: int4 there costs 0.013-0.067 of argmax agreement with bf16 (int8: under
# 0.007) for 9-21% more tokens/s; int6 (7 bits a weight with its scales, against int8's 9) costs what int8 does and
# reads a fifth less; docs/QUANT.md, "The output layer".
HEAD_WEIGHTS = "int6"
CACHE_FORMAT = 5  # bump when the cache's layout or quantization math changes
SCHEME = {  # written into each cache manifest, for whoever reads one
    "int8": "symmetric, one scale per output channel: w = q * scale (torch's kernel); asymmetric per 32 "
    "inputs, float16 scale and min: w = q * scale + min (vnni)",
    "int4": "asymmetric per group of input weights, step (max - min) / levels with the least squared "
    f"error for levels in {INT4_LEVELS}: w = (q - 8) * scale + zero (torch's kernel), or with float16 "
    "scale and min = zero - 8 * scale: w = q * scale + min (vnni)",
    "int6": "asymmetric per 32 inputs, float16 scale and min: w = q * scale + min, q in 0..63 (vnni only)",
    "gguf": "the GGUF file's own blocks, every value unchanged: Q4_K and Q6_K in super-blocks of 256 inputs with integer "
    "sub-scales, Q4_1 / Q5_0 / Q8_0 as int4 / int6 / int8 per 32 inputs (gguf_blocks.py; vnni only)",
}


class UnsupportedLayer(ValueError):
    """A linear layer that a kernel cannot take (shape, device or dtype)."""


class QuantLinear(nn.Module):
    """Shared forward: flatten [..., in] to the 2D contiguous input the kernels need, add the bias."""

    precision: str
    dtype = torch.bfloat16  # the activation dtype; quantize_model sets the model's

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # A buffer, not a parameter: these layers are for inference only.
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._mm(x.reshape(-1, self.in_features).contiguous())
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in the activation dtype, as the kernel sees it (for drafters that take
        rows of a quantized output layer): the kernel applied to the identity."""
        device = next(iter(self.packed_tensors().values())).device
        return self._mm(torch.eye(self.in_features, dtype=self.dtype, device=device)).T.contiguous()

    def packed_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that rebuild this layer (the bias stays with the model it came from)."""
        return {name: t for name, t in self.named_buffers(recurse=False) if name != "bias"}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q [N, K] int8, scales [N] in `dtype`); w ~ q * scale."""
    w = weight.float()
    # Round the scale to its stored dtype first, so q is the best code for the scale actually used.
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(dtype)
    q = torch.round(w / scales.float()[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scales


def quantize_int4(weight: torch.Tensor, group_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4 in torch's convention: (q [N, K] int32 in 0..15, scales_and_zeros
    [K / group, N, 2] in `dtype`); w ~ (q - 8) * scale + zero, with q = 0 at the group's minimum."""
    n, k = weight.shape
    # Row chunks bound the float32 temporaries (the Qwen output layer has 151,936 rows).
    parts = [_quantize_int4_rows(rows, group_size, dtype) for rows in weight.split(ROWS_PER_CHUNK)]
    q = torch.cat([p[0] for p in parts]).reshape(n, k)
    return q, torch.cat([p[1] for p in parts], dim=1)


def _quantize_int4_rows(weight: torch.Tensor, group_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group, the step with the least squared error among (max - min) / levels, levels in
    INT4_LEVELS. Weights converted from a 4-bit GGUF (Q4_K) sit on a grid per group whose top code
    a group often leaves unused: then max - min spans 14 steps, not 15, and only the search lands
    on the grid again (0.5% weight error instead of 4.3% on the Qwen-1.5B; docs/QUANT.md)."""
    w = weight.float().reshape(weight.shape[0], -1, group_size)
    low, high = w.amin(dim=2), w.amax(dim=2)

    def scale_zero(levels: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
        # Rounded to the stored dtype first, so codes and errors are those of the values stored.
        scales = ((high - low) / levels).clamp(min=1e-12).to(dtype).float()
        return scales, (low + 8 * scales).to(dtype).float()

    def positions(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
        return (w - zeros[..., None]) / scales[..., None] + 8  # where each weight falls on the code axis

    errors = []
    for levels in INT4_LEVELS:
        scales, zeros = scale_zero(levels)
        t = positions(scales, zeros)
        errors.append((t.round().clamp(0, 15) - t).square().sum(dim=2) * scales.square())
    scales, zeros = scale_zero(torch.tensor(INT4_LEVELS, device=w.device)[torch.stack(errors).argmin(dim=0)])
    q = positions(scales, zeros).round().clamp(0, 15).to(torch.int32)
    return q, torch.stack([scales.to(dtype), zeros.to(dtype)], dim=2).transpose(0, 1)


class Int8Linear(QuantLinear):
    """y = x @ (q * scale).T + bias, with q int8 per output channel."""

    precision = "int8"

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        q, scales = quantize_int8(linear.weight.detach(), linear.weight.dtype)
        return cls(q, scales, linear.bias)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)


def _cuda_inner_k_tiles(in_features: int) -> int:
    """The widest k-tiling (8, 4 or 2 tiles of 16) that divides in_features: wider loads are faster."""
    return next(t for t in (8, 4, 2) if in_features % (16 * t) == 0)


def int4_unsupported(out_features: int, in_features: int, group_size: int, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the int4 kernels cannot take this layer, or None when they can."""
    if group_size not in INT4_GROUP_SIZES:
        return f"group size {group_size} is not one of {INT4_GROUP_SIZES}"
    if in_features % group_size:
        return f"in_features {in_features} is not a multiple of the group size {group_size}"
    if device.type == "cpu":
        return None if out_features % 16 == 0 else f"out_features {out_features} is not a multiple of 16 (CPU int4 kernel)"
    if device.type == "cuda":
        if dtype != torch.bfloat16:
            return f"the CUDA int4 kernel takes bf16 activations, not {dtype}"
        return None if out_features % 8 == 0 else f"out_features {out_features} is not a multiple of 8 (CUDA int4 kernel)"
    return f"no int4 kernel for device {device.type}"


class Int4Linear(QuantLinear):
    """y = x @ dequant(q).T + bias, with q int4 in groups of `group_size` along the input."""

    precision = "int4"

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None = None):
        super().__init__(scales_and_zeros.shape[0] * group_size, scales_and_zeros.shape[1], bias)
        self.group_size = group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = DEFAULT_GROUP_SIZE) -> Int4Linear:
        weight = linear.weight.detach()
        reason = int4_unsupported(*weight.shape, group_size, weight.device, weight.dtype)
        if reason:
            raise UnsupportedLayer(f"int4: {reason}")
        q, scales_and_zeros = quantize_int4(weight, group_size, weight.dtype)
        if weight.device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        else:
            # The CUDA packer takes two codes per byte, the even column in the high nibble.
            pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs, _cuda_inner_k_tiles(weight.shape[1]))
        return cls(packed, scales_and_zeros, group_size, linear.bias)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group_size, self.scales_and_zeros)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


def quantize_uint_groups(weight: torch.Tensor, group_size: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric `bits`-bit per group of input weights: (q [N, K] in 0..2^bits - 1, scales, mins [N, K / group]
    float16); w ~ q * scale + min."""
    top = 2**bits - 1
    w = weight.float().reshape(weight.shape[0], -1, group_size)
    mins = w.amin(dim=2).half().float()
    scales = ((w.amax(dim=2) - mins) / top).clamp(min=1e-7).half().float()
    q = ((w - mins[..., None]) / scales[..., None]).round().clamp(0, top).to(torch.int32)
    return q.reshape(weight.shape), scales.half(), mins.half()


class VnniLinear(QuantLinear):
    """y = x @ dequant(q).T + bias on our kernel (vnni.py): w = q * scale + min per 32 inputs with
    int4 or int8 codes q and float16 scales and mins; x rounded to int8 per 32 inputs."""

    def __init__(self, packed: torch.Tensor, scale_min: torch.Tensor, bias: torch.Tensor | None = None,
                 parts: tuple[int, ...] = ()):
        super().__init__(packed.shape[1] * vnni.inputs_per_block(packed), packed.shape[0] * vnni.ROWS, bias)
        self.precision = vnni.format_name(packed)
        self.register_buffer("packed", packed)
        self.register_buffer("scale_min", scale_min)
        self.parts = parts  # a fused layer's parts, in blocks of vnni.ROWS outputs (`fuse`)
        self.keeps_dequantized = False  # long passes keep their bf16 weights for the next (keep_dequantized)
        self._dequantized: list[torch.Tensor] | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, precision: str) -> VnniLinear:
        weight = linear.weight.detach()
        if precision == "int4":
            q, scales_and_zeros = quantize_int4(weight, vnni.GROUP_SIZE, torch.float16)
            scales, zeros = scales_and_zeros.float().transpose(0, 1).unbind(dim=2)
            packed = vnni.pack(q, scales, zeros - 8 * scales, bits=4)
        else:
            bits = int(precision.removeprefix("int"))
            packed = vnni.pack(*quantize_uint_groups(weight, vnni.GROUP_SIZE, bits), bits=bits)
        return cls(*packed, linear.bias)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if not vnni.dequantizes(x.shape[0], self.keeps_dequantized):
            return vnni.mm(x, self.packed, self.scale_min)
        # There the product is a bf16 GEMM, whose sums are blocked by the output count: each part's own product
        # then, as its own layer computes it.
        sizes = self.parts or (self.packed.shape[0],)
        parts = list(zip(self.packed.split(sizes), self.scale_min.split(sizes)))
        if self.keeps_dequantized and self._dequantized is None:
            self._dequantized = [vnni.kept_weights(packed, scale_min, x.dtype) for packed, scale_min in parts]
        kept = self._dequantized or [None] * len(parts)
        return torch.cat([vnni.mm(x, packed, scale_min, weights) for (packed, scale_min), weights in zip(parts, kept)], dim=-1)

    @torch.no_grad()
    def dequantize(self) -> torch.Tensor:
        # The kernel's own dequantization: the identity through the kernel would be a full matmul.
        return vnni.dequantize_t(self.packed, self.scale_min).T.to(self.dtype).contiguous()


class FusedLinear(QuantLinear):
    """Layers that read the same input but hold different formats (a GGUF file's q and k in Q4_K, its v in Q6_K): each
    run of one format fused (`fuse`), their outputs side by side, each run computing what its own layers do."""

    precision = "mixed"

    def __init__(self, runs: list[VnniLinear]):
        super().__init__(runs[0].in_features, sum(run.out_features for run in runs), None)
        self.runs = nn.ModuleList(runs)
        self.dtype = runs[0].dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([run(x) for run in self.runs], dim=-1)


def fuse(layers: list[nn.Module]) -> VnniLinear | FusedLinear | None:
    """One layer for `layers` that read the same input (q, k and v; gate and up): their outputs side by side. Layers
    of one precision become one VnniLinear (`_fuse_run`); layers of several, a FusedLinear of each run of one. None
    (nothing changed) unless all are VnniLinear and each run's biases are on all its layers or on none."""
    if not all(isinstance(layer, VnniLinear) for layer in layers):
        return None
    runs = [list(run) for _, run in itertools.groupby(layers, key=lambda layer: layer.precision)]
    fused = [run[0] if len(run) == 1 and len(runs) > 1 else _fuse_run(run) for run in runs]
    if any(run is None for run in fused):
        return None
    return fused[0] if len(fused) == 1 else FusedLinear(fused)


def _fuse_run(layers: list[VnniLinear]) -> VnniLinear | None:
    """One VnniLinear for layers of one precision: their outputs side by side, from one activation quantization and
    one kernel call. Each output row is its own integer dot products with the same float epilogue, so the fused
    outputs equal the separate ones bit for bit (passes long enough to dequantize multiply each part apart, for the
    same reason). The layers' own weights become views of the fused ones, so nothing is kept twice. None unless
    their biases are on all or on none."""
    biases = [layer.bias for layer in layers]
    if any(bias is None for bias in biases) and any(bias is not None for bias in biases):
        return None
    fused = VnniLinear(torch.cat([layer.packed for layer in layers]), torch.cat([layer.scale_min for layer in layers]),
                       None if biases[0] is None else torch.cat(biases), tuple(layer.packed.shape[0] for layer in layers))
    fused.dtype = layers[0].dtype
    fused.keeps_dequantized = layers[0].keeps_dequantized
    for layer, packed, scale_min in zip(layers, fused.packed.split(fused.parts), fused.scale_min.split(fused.parts)):
        layer.packed, layer.scale_min = packed, scale_min
    return fused


_fused: weakref.WeakKeyDictionary[nn.Module, list] = weakref.WeakKeyDictionary()


def fused_projections(model: nn.Module) -> list[tuple[VnniLinear | FusedLinear | None, VnniLinear | FusedLinear | None]]:
    """Per decoder layer of a Llama-family model, its fused q/k/v and gate/up projections (`fuse`; None where
    they cannot be fused), made once per model: every runner over it shares them."""
    if model not in _fused:
        _fused[model] = [
            (fuse([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
             fuse([layer.mlp.gate_proj, layer.mlp.up_proj]))
            for layer in model.get_decoder().layers
        ]
    return _fused[model]


def keep_dequantized(model: nn.Module, keep: bool) -> None:
    """Whether `model`'s kernel layers (and its fused projections) keep the bf16 weights their first long pass
    dequantizes (2.6 GB for a 1.5B model): a chunked prefill's every chunk then costs its product, not a
    dequantization of every weight. The kept weights are the ones dequantized each time; on AMX prepacked for
    oneDNN's matmul (vnni.kept_weights), which rounds as its own: every long pass of a kept layer takes them."""
    fused = [part for pair in _fused.get(model, ()) for layer in pair if layer is not None for part in layer.modules()]
    for layer in [*model.modules(), *fused]:
        if isinstance(layer, VnniLinear):
            layer.keeps_dequantized = keep
            if not keep:
                layer._dequantized = None


def on_kernel(model: nn.Module) -> bool:
    """Whether `model`'s linear layers are all on our kernel (VnniLinear), so that its row-invariant passes, a long
    prefill's too, multiply as decoding does (vnni.row_invariant)."""
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, QuantLinear))]
    return bool(layers) and all(isinstance(m, VnniLinear) for m in layers)


def kernel(device: torch.device, group_size: int) -> str:
    """Which kernels a device gets: ours (`vnni`) where it runs, else torch's for the device."""
    return "vnni" if vnni.supports(vnni.ROWS, vnni.GROUP_SIZE, group_size, device) else device.type


def _quantize_layer(linear: nn.Linear, precision: str, group_size: int) -> QuantLinear:
    """`linear` at `precision`, trying one run of the kernel so that a device's unknown limits show here."""
    weight = linear.weight
    if vnni.supports(*weight.shape, group_size, weight.device):
        layer = VnniLinear.from_linear(linear, precision)
    elif precision == "int6":
        raise UnsupportedLayer("int6 runs on our kernel only, which does not run here")
    elif precision == "int8":
        layer = Int8Linear.from_linear(linear)
    else:
        layer = Int4Linear.from_linear(linear, group_size)
    layer.dtype = weight.dtype
    layer(torch.zeros(1, layer.in_features, dtype=weight.dtype, device=weight.device))
    return layer


def _quantize_with_fallback(name: str, linear: nn.Linear, precision: str, group_size: int) -> QuantLinear | None:
    """The layer at `precision`, else at the next wider one that every kernel runs (where int4 fails on ours, int6
    would fail for the same reason); None keeps the float layer. Fallbacks are logged."""
    wider = [p for p in QUANTIZED if PRECISIONS.index(p) > PRECISIONS.index(precision)]
    for candidate in [precision, *wider]:
        try:
            return _quantize_layer(linear, candidate, group_size)
        except (UnsupportedLayer, RuntimeError) as error:
            log.warning("quantize: %s cannot be %s (%s); trying a wider precision", name, candidate, error)
    log.warning("quantize: %s stays %s", name, linear.weight.dtype)
    return None


def quantize_linears(module: nn.Module, precision: str, group_size: int = DEFAULT_GROUP_SIZE) -> None:
    """Replace `module`'s nn.Linear layers in place at `precision` (one of QUANTIZED), each falling back as
    quantize_model's do: a drafter's own small network, with no packed cache and no GGUF file."""
    for name, linear in _linears(module).items():
        layer = _quantize_with_fallback(name, linear, precision, group_size)
        if layer is not None:
            _replace(module, name, layer)


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _fingerprint(linears: dict[str, nn.Linear]) -> str:
    """A cheap hash of the float weights (names, shapes, first and last rows): a cache made from
    other weights must not be served. Reads a few pages, not the (lazily mapped) weights."""
    digest = hashlib.sha256()
    for name, linear in linears.items():
        w = linear.weight.detach()
        digest.update(f"{name}{tuple(w.shape)}{w.dtype}".encode())
        digest.update(w[[0, -1]].float().cpu().numpy().tobytes())
    return digest.hexdigest()


def cache_file(model_dir: str | Path, weights: str, group_size: int, device: torch.device) -> Path:
    """Where a model's packed weights live: the packing is kernel-specific, so the name says which."""
    group = f"-g{group_size}" if weights == "int4" else ""
    return Path(model_dir) / f"packed-{weights}{group}-{kernel(device, group_size)}.safetensors"


def _write_atomically(path: Path, write) -> None:
    """write(tmp) then rename, so a reader never sees half a file."""
    tmp = path.with_name(f"{path.name}.partial-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def quantize_model(
    model: nn.Module,
    weights: str,
    group_size: int = DEFAULT_GROUP_SIZE,
    cache_path: str | Path | None = None,
    head_weights: str | None = None,
    gguf: GgufFile | None = None,
) -> dict[str, str]:
    """Replace the model's nn.Linear layers in place by Int8Linear / Int4Linear / VnniLinear; return each
    replaced layer's precision by name.

    `weights` is one of PACKED: int4 or int8 quantize the float weights; gguf takes each layer's blocks from the
    GGUF file `gguf` (every value the file's; a tensor type without a kernel format falls back to int8 of the file's
    values, logged).
    `head_weights` is the output layer's precision (one of PRECISIONS; another name leaves it float); None:
    HEAD_WEIGHTS on our kernel, int8 on torch's. gguf weights take the file's head too.
    With `cache_path`, packed weights made from the same float weights with the same settings are
    loaded from there instead of quantizing again; otherwise they are quantized and saved there.
    """
    if weights not in PACKED:
        raise ValueError(f"weights {weights!r} is not one of {PACKED}")
    linears = _linears(model)
    head = next((name for name, module in linears.items() if module is model.get_output_embeddings()), None)
    wanted = {name: weights for name in linears}
    some = next(iter(linears.values()))
    # gguf layers need no float weights: a model built on the meta device takes them, on the CPU.
    device = torch.device("cpu") if weights == GGUF else some.weight.device
    kernel_name = kernel(device, group_size)
    if weights == GGUF and (gguf is None or kernel_name != "vnni"):
        raise ValueError("weights: gguf needs a registry model's GGUF file and our CPU kernel (x86 with AVX2); "
                         "use weights: int4 or int8 here")
    if head and weights != GGUF:
        wanted[head] = head_weights or (HEAD_WEIGHTS if kernel_name == "vnni" else "int8")
    key = {
        "format": CACHE_FORMAT,
        "torch": torch.__version__,
        "device": device.type,
        "dtype": str(some.weight.dtype),
        "group_size": group_size,
        "kernel": kernel_name,
        "wanted": wanted,
        "source": {"gguf": gguf.path.name, "bytes": gguf.path.stat().st_size} if weights == GGUF else _fingerprint(linears),
    }
    manifest_path = Path(cache_path).with_suffix(".json") if cache_path else None
    manifest = json.loads(manifest_path.read_text()) if manifest_path and manifest_path.is_file() else {}
    if manifest.get("key") == key:
        _load_cached(model, linears, Path(cache_path), manifest["layers"], group_size, device)
        log.info("quantize: loaded %d packed layers from %s", len(manifest["layers"]), cache_path)
        return manifest["layers"]

    layers = {}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    # A 1.5B model takes minutes (the step search): show progress, except for small test models.
    for name, precision in tqdm(wanted.items(), desc=f"{'repack' if weights == GGUF else 'quantize to'} {weights}",
                                unit="layer", disable=len(wanted) < 100):
        # pop: the float layer is freed as soon as its replacement is in (peak memory on CUDA).
        linear = linears.pop(name)
        if precision == GGUF:
            layer = _gguf_layer(name, linear, gguf, tied and name == head)
        elif precision in PRECISIONS:
            layer = _quantize_with_fallback(name, linear, precision, group_size)
        else:
            continue
        if layer:
            _replace(model, name, layer)
            layers[name] = layer.precision
    if cache_path:
        tensors = {f"{name}.{t}": v.cpu() for name in layers for t, v in model.get_submodule(name).packed_tensors().items()}
        _write_atomically(Path(cache_path), lambda tmp: save_file(tensors, str(tmp)))
        made = {"key": key, "layers": layers, "scheme": SCHEME, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        _write_atomically(manifest_path, lambda tmp: tmp.write_text(json.dumps(made, indent=1) + "\n"))
    return layers


def _gguf_layer(name: str, linear: nn.Linear, gguf: GgufFile, tied_head: bool) -> QuantLinear | None:
    """The layer from its GGUF tensor's own blocks (its bias stays the model's); where its type has no kernel format,
    int8 of the file's values."""
    try:
        layer = VnniLinear(*gguf.linear(name, tied_head), linear.bias)
    except UnsupportedTensor as error:
        log.warning("quantize: %s: %s; taking int8 of the file's values", name, error)
        values = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, dtype=linear.weight.dtype)
        with torch.no_grad():
            for kind, parameter in values.named_parameters():
                parameter.copy_(gguf.values(f"{name}.{kind}", tied_head))
        return _quantize_with_fallback(name, values, "int8", DEFAULT_GROUP_SIZE)
    if (layer.out_features, layer.in_features) != tuple(linear.weight.shape):
        raise ValueError(f"{name}: the GGUF tensor is {layer.out_features} x {layer.in_features}, the model's "
                         f"{tuple(linear.weight.shape)}")
    layer.dtype = linear.weight.dtype
    return layer


def _load_cached(model: nn.Module, linears: dict[str, nn.Linear], path: Path, layers: dict[str, str], group_size: int,
                 device: torch.device) -> None:
    # Copies, not views of the file: safetensors places tensors at arbitrary offsets, and the CPU
    # int8 kernel faults on weights that are not 64-byte aligned (torch's allocator aligns them).
    tensors = {name: t.to(device, copy=True) for name, t in load_file(str(path)).items()}
    for name, precision in layers.items():
        bias = linears[name].bias
        if f"{name}.scale_min" in tensors:
            layer = VnniLinear(tensors[f"{name}.packed"], tensors[f"{name}.scale_min"], bias)
        elif precision == "int4":
            layer = Int4Linear(tensors[f"{name}.packed"], tensors[f"{name}.scales_and_zeros"], group_size, bias)
        else:
            layer = Int8Linear(tensors[f"{name}.weight"], tensors[f"{name}.scales"], bias)
        layer.dtype = linears[name].weight.dtype
        _replace(model, name, layer)
