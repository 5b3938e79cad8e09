"""Our CPU kernel for quantized linear layers (vnni.cpp): int4 or int8 weights times int8 activations
on AVX-512 VNNI, and on AMX-INT8 tiles for passes of several rows.

torch's CPU int4 kernel converts every weight to a float per token, and its int8 kernel multiplies
in floats too; this one multiplies integer codes, as llama.cpp does: a one-token pass with
`vpdpbusd`, a pass of AMX_MIN_ROWS to DEQUANTIZE_ROWS - 1 rows (verification, short prefills) with
`tdpbsud` on AMX tiles where SPECDEC_ISA=amx asks for them (measured slower than VNNI on a Xeon with AMX,
so off by default; docs/QUANT.md has the per-layer costs). Both paths compute bit-identical results, so a
row's result never depends on the pass.
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
# SPECDEC_ISA forces the path of the integer passes: "avx512" (every pass on VNNI's vpdpbusd) or "amx" (passes
# of AMX_MIN_ROWS rows or more on AMX-INT8 tiles, where the CPU has them). The default is avx512 on every CPU:
# on a Xeon with AMX (2 threads) the tiles lost to VNNI at every pass of 2 to 512 rows, at 8 rows 1.3-1.9x
# its time (docs/QUANT.md, "AMX, measured"), because each group of 32 inputs ends in a float epilogue.
ISA_ENV = "SPECDEC_ISA"
ISAS = ("avx512", "amx")
DEFAULT_ISA = "avx512"
COMPILE_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma"]
# From this many rows (a long prompt's prefill) dequantizing the weights to bf16 and multiplying on
# the CPU's matrix units beats the VNNI dot products (8960 x 1536, 2 threads: at 64 rows 9.3 ms
# against 8.0, at 256 rows 17 ms against 30; docs/QUANT.md). On a Xeon with AMX, VNNI with 8 rows per
# register block: 12.8 ms against 17.4 at 128 rows, level at 256, 51 against 26 at 512; AMX tiles no faster.
DEQUANTIZE_ROWS = 128
# With SPECDEC_ISA=amx, from this many rows a pass runs on AMX tiles (one-token decode stays on VNNI).
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


def isa() -> str:
    """The kernel path SPECDEC_ISA asks for (ISAS), DEFAULT_ISA when unset."""
    chosen = os.environ.get(ISA_ENV, DEFAULT_ISA)
    if chosen not in ISAS:
        raise ValueError(f"{ISA_ENV}={chosen!r} is not one of {', '.join(ISAS)}")
    return chosen


@functools.cache
def amx_missing() -> str | None:
    """Why AMX tiles cannot run here, or None where they can: the CPU has AMX-INT8 and Linux grants the tile state."""
    if extension() is None:
        return "no VNNI kernel"
    missing = [flag for flag in AMX_FLAGS if flag not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if not extension().amx_enable():
        return "Linux refused the tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return None


@functools.cache
def _tiles_chosen() -> bool:
    """Whether passes of AMX_MIN_ROWS rows or more run on AMX tiles: SPECDEC_ISA=amx where they can run. Logged once."""
    if isa() == "amx" and amx_missing() is None:
        log.info("quantize: passes of %d to %d rows on AMX-INT8 tiles (%s=amx), one-token passes on AVX-512 VNNI",
                 AMX_MIN_ROWS, DEQUANTIZE_ROWS - 1, ISA_ENV)
        return True
    reason = f"{ISA_ENV}={isa()}" if isa() != "amx" else f"{ISA_ENV}=amx, but {amx_missing()}"
    log.info("quantize: passes below %d rows on AVX-512 VNNI (%s)", DEQUANTIZE_ROWS, reason)
    return False


@torch.compiler.assume_constant_result  # settled once per process: a compiled pass takes it as a constant
def amx() -> bool:
    """Whether passes of AMX_MIN_ROWS rows or more run on AMX tiles."""
    return _tiles_chosen()


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
