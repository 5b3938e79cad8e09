"""Our CPU kernel for quantized linear layers (vnni.cpp): int4 or int8 weights times int8 activations
on AVX-512 VNNI, and on AMX-INT8 tiles for passes of several rows.

torch's CPU int4 kernel converts every weight to a float per token, and its int8 kernel multiplies
in floats too; this one multiplies integer codes, as llama.cpp does: a one-token pass with
`vpdpbusd`, a pass of AMX_MIN_ROWS to DEQUANTIZE_ROWS - 1 rows (verification, short prefills) with
`tdpbsud` on AMX tiles where the CPU has them, which leaves a quarter of VNNI's per-row instructions
(the float epilogue; a VNNI pass of 6 rows costs about twice one row's; docs/QUANT.md has the
per-layer costs, and says what of the AMX path is still unmeasured). Both paths compute bit-identical results, so a row's result never depends on the pass.
Weights are group-wise, w = q * scale + min per 32 inputs. It is compiled once per machine with
torch's extension builder (g++ and ninja; about a minute) and used where the CPU has the
instructions; elsewhere `quant.Int4Linear` / `quant.Int8Linear` keep torch's kernels.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

from .kernels import build, cpu_flags, traceable

log = logging.getLogger("specdec")

GROUP_SIZE = 32  # inputs per scale and min; fixed by the kernel
ROWS = 16  # output rows per block: one AVX-512 register of int32 sums
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma")
AMX_FLAGS = ("amx_tile", "amx_int8")
# SPECDEC_AMX=0 keeps every pass on VNNI (the fallback, for comparisons and for tests).
AMX_ENV = "SPECDEC_AMX"
COMPILE_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma"]
# From this many rows (a long prompt's prefill) dequantizing the weights to bf16 and multiplying on
# the CPU's matrix units beats the VNNI dot products (8960 x 1536, 2 threads: at 64 rows 9.3 ms
# against 8.0, at 256 rows 17 ms against 30; docs/QUANT.md). Not yet measured against the AMX path.
DEQUANTIZE_ROWS = 128
# From this many rows a pass runs on AMX tiles where it can (one-token decode stays on VNNI); not
# yet measured: VNNI may still win at 2-3 rows (docs/QUANT.md).
AMX_MIN_ROWS = 2
SOURCE = Path(__file__).with_name("vnni.cpp")


_cpu_flags = cpu_flags  # a module attribute, so that tests can stand in another CPU


@functools.cache
def extension():
    """The compiled kernel, or None where the CPU lacks the instructions or it cannot be built (logged once)."""
    missing = [flag for flag in CPU_FLAGS if flag not in _cpu_flags()]
    if missing:
        log.info("quantize: this CPU lacks %s; using torch's int4 / int8 kernels", ", ".join(missing))
        return None
    kernel = build("specdec_vnni", SOURCE, COMPILE_FLAGS, "the AVX-512 VNNI kernel")
    if kernel is None:
        log.warning("quantize: using torch's int4 / int8 kernels, which are slower")
    return kernel


@functools.cache
def amx_missing() -> str | None:
    """Why passes of AMX_MIN_ROWS rows or more cannot run on AMX tiles here, or None where they do: the
    CPU has AMX-INT8, Linux grants the tile state, and SPECDEC_AMX is not 0. Logged once."""
    if extension() is None:
        return "no VNNI kernel"
    missing = [flag for flag in AMX_FLAGS if flag not in _cpu_flags()]
    if os.environ.get(AMX_ENV, "1") == "0":
        reason = f"{AMX_ENV}=0"
    elif missing:
        reason = f"this CPU lacks {', '.join(missing)}"
    elif not extension().amx_enable():
        reason = "Linux refused the tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    else:
        log.info("quantize: passes of %d to %d rows on AMX-INT8 tiles, one-token passes on AVX-512 VNNI",
                 AMX_MIN_ROWS, DEQUANTIZE_ROWS - 1)
        return None
    log.info("quantize: no AMX (%s); passes below %d rows on AVX-512 VNNI", reason, DEQUANTIZE_ROWS)
    return reason


@torch.compiler.assume_constant_result  # settled once per process: a compiled pass takes it as a constant
def amx() -> bool:
    """Whether passes of AMX_MIN_ROWS rows or more run on AMX tiles."""
    return amx_missing() is None


def supports(out_features: int, in_features: int, group_size: int, device: torch.device) -> bool:
    return (device.type == "cpu" and group_size == GROUP_SIZE and out_features % ROWS == 0
            and in_features % GROUP_SIZE == 0 and extension() is not None)


def pack(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes q [N, K] in 0..2^bits - 1 with scales and mins [N, K / 32] (w = q * scale + min) in the
    kernel's layout: packed [N/16, K/32, bits, 64] uint8 and scale_min [N/16, K/32, 2, 16] float16."""
    n, k = q.shape
    # Operand i of a group holds inputs 4i..4i+3 of 16 rows, row-major (vnni.cpp).
    operands = q.to(torch.uint8).view(n // ROWS, ROWS, k // GROUP_SIZE, 8, 4).permute(0, 2, 3, 1, 4)
    if bits == 4:  # operands 2c and 2c + 1 share chunk c: low and high nibbles
        operands = operands[:, :, 0::2] | operands[:, :, 1::2] << 4
    packed = operands.reshape(n // ROWS, k // GROUP_SIZE, bits, 64).contiguous()
    per_group = torch.stack([scales.half(), mins.half()]).view(2, n // ROWS, ROWS, k // GROUP_SIZE)
    return packed, per_group.permute(1, 3, 0, 2).contiguous()


def _vnni_dequantize_t(packed: torch.Tensor, scale_min: torch.Tensor) -> torch.Tensor:
    return extension().vnni_dequantize_t(packed, scale_min)


def _vnni_mm(x: torch.Tensor, packed: torch.Tensor, scale_min: torch.Tensor, tiles: bool) -> torch.Tensor:
    return extension().vnni_mm(x, packed, scale_min, tiles)


# The weights, transposed: [K, N] bf16.
dequantize_t = traceable(
    _vnni_dequantize_t,
    lambda packed, scale_min: packed.new_empty(packed.shape[1] * GROUP_SIZE, packed.shape[0] * ROWS, dtype=torch.bfloat16),
)
_mm = traceable(_vnni_mm, lambda x, packed, scale_min, tiles: x.new_empty(x.shape[0], packed.shape[0] * ROWS))


def mm(x: torch.Tensor, packed: torch.Tensor, scale_min: torch.Tensor) -> torch.Tensor:
    """x [M, K] (contiguous) @ dequant(weights).T, in x's dtype. Below DEQUANTIZE_ROWS rows x is rounded
    to int8 per 32 inputs, and each row's result is the same whatever the number of rows and whichever
    path (VNNI or AMX) takes it (a verify pass computes what single steps do); from there on the
    weights are dequantized to bf16."""
    rows = x.shape[0]
    if rows >= DEQUANTIZE_ROWS:
        return torch.mm(x, dequantize_t(packed, scale_min).to(x.dtype))
    tiles = rows >= AMX_MIN_ROWS and amx()
    if x.dtype not in (torch.float32, torch.bfloat16):  # the kernel reads and writes these two
        return _mm(x.float(), packed, scale_min, tiles).to(x.dtype)
    return _mm(x, packed, scale_min, tiles)


def group_sums(x: torch.Tensor, packed: torch.Tensor, scale_min: torch.Tensor, tiles: bool) -> torch.Tensor:
    """The int32 sums [M, K/32, N] per row of x, group of 32 inputs and output, from the AMX path
    (tiles, which needs amx()) or the VNNI one: for tests."""
    return extension().vnni_group_sums(x, packed, scale_min, tiles)
