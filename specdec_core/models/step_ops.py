"""The static step's work around its linear layers, fused (step_ops.h, compiled into every kernel family's
extension): a residual add with the RMSNorm after it, and the rotary embedding with the cache write, each one
call instead of several ATen ops; and, where a layer's projections are all on our kernel, the whole layer in
two calls around its attention (`KernelLayer`). Each computes transformers' numbers bit for bit. Where they
cannot run (a GPU, a pass being compiled, no kernel family) the static step calls the modules themselves.
"""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import Any

import torch
from torch import nn

from . import vnni
from .quant import FusedLinear, VnniLinear, fused_projections


def extension() -> ModuleType | None:
    """The compiled ops (this process's kernel family's extension), or None where no family runs or builds."""
    return vnni.extension()


def for_pass(hidden: torch.Tensor) -> ModuleType | None:
    """The fused ops for a pass over `hidden`, or None where the pass calls the modules: off the CPU, while
    torch.compile traces the pass (inductor fuses these chains itself), or without the built ops."""
    if hidden.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    return extension()


_kernel_layers: weakref.WeakKeyDictionary[nn.Module, tuple[ModuleType, list | None]] = weakref.WeakKeyDictionary()


def kernel_layers(model: nn.Module) -> list[Any] | None:
    """`model`'s decoder layers as the extension's KernelLayers (made once per model and kernel family), or None
    unless every layer can be one: its q/k/v and gate/up fused on our kernel (quant.fused_projections), o_proj and
    down_proj on it too, a SiLU MLP, and norms of the model's dtype."""
    ops = extension()
    made = _kernel_layers.get(model)
    if made is None or made[0] is not ops:  # a family chosen anew (SPECDEC_ISA in tests and tools) makes its own
        made = _kernel_layers[model] = (ops, _made_kernel_layers(model, ops))
    return made[1]


def _made_kernel_layers(model: nn.Module, ops: ModuleType | None) -> list[Any] | None:
    if ops is None or getattr(model.config, "hidden_act", None) != "silu":
        return None
    layers = []
    for layer, (qkv, gate_up) in zip(model.get_decoder().layers, fused_projections(model)):
        attention, mlp = layer.self_attn, layer.mlp
        projections = (qkv, attention.o_proj, gate_up, mlp.down_proj)
        if not all(isinstance(p, (VnniLinear, FusedLinear)) for p in projections):
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if len({*(norm.weight.dtype for norm in norms), qkv.dtype}) != 1 or len({norm.variance_epsilon for norm in norms}) != 1:
            return None
        sizes = [attention.q_proj.out_features, attention.k_proj.out_features, attention.v_proj.out_features]
        layers.append(ops.kernel_layer(
            layer.input_layernorm.weight, *_weights(qkv), sizes, *_weights(attention.o_proj), layer.post_attention_layernorm.weight,
            *_weights(gate_up), *_weights(mlp.down_proj), layer.input_layernorm.variance_epsilon,
        ))
    return layers


def _weights(projection: VnniLinear | FusedLinear) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor | None]]:
    """A projection's packed weights, scales and mins, and biases, one each per run of one format, as KernelLayer takes
    them."""
    runs = projection.runs if isinstance(projection, FusedLinear) else [projection]
    return [run.packed for run in runs], [run.scale_min for run in runs], [run.bias for run in runs]


def takes_kernel_layers(hidden: torch.Tensor, kept: bool) -> bool:
    """Whether a pass over `hidden` [B, k, H] may run KernelLayers: on the fused ops, with activations the kernel
    reads, and short enough (or row-invariant) that every projection takes the kernel, not dequantized weights
    (`kept`: the model keeps its bf16 weights, quant.keep_dequantized)."""
    rows = hidden.shape[0] * hidden.shape[1]
    return (for_pass(hidden) is not None and hidden.dtype in (torch.float32, torch.bfloat16)
            and not vnni.dequantizes(rows, kept))
